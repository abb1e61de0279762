"""What a user brings to a launch, built locally (nothing downloaded), and what the run
must show of it: a Hugging Face checkpoint whose tokenizer carries a chat template, a
``datasets`` folder with its own column names, and the three trackers (docs/tracking.md)."""

from __future__ import annotations

import json
from pathlib import Path

from staleflow.data.synthetic import ALPHABET, ArithmeticConfig, ArithmeticTask

# the system message (data.system_prompt=0) then ':', then the user's text as written
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'system' %}:{% endif %}"
    "{% endfor %}"
)


def hf_policy_and_dataset(folder: Path) -> tuple[Path, Path]:
    """(checkpoint, dataset folder): the micro model (untrained) with a character-level
    ``PreTrainedTokenizerFast`` and :data:`TEMPLATE`, and 64 arithmetic problems saved
    with ``save_to_disk`` under the columns ``problem`` and ``solution``."""
    import datasets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from staleflow.data.tokenizer import HFTokenizer
    from staleflow.models.build import qwen2_config

    words = ["<pad>", "<s>", "</s>", "<unk>", *ALPHABET, ":"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()  # characters joined back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = TEMPLATE
    checkpoint = folder / "policy"
    tokenizer.save_pretrained(checkpoint)
    vocab = len(words)
    for _ in range(2):
        config = qwen2_config("micro", vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        Qwen2ForCausalLM(config).save_pretrained(checkpoint)
        # transformers 5 loads the tokenizer next to a qwen2 config.json as Qwen2Tokenizer,
        # which adds '<|endoftext|>': the embedding takes the ids the loaded one has
        vocab = HFTokenizer(checkpoint).vocab_size
        if vocab == config.vocab_size:
            break
    problems = ArithmeticTask(ArithmeticConfig.level(1, seed=5)).problems(64, 0)
    data = folder / "prompts"
    datasets.Dataset.from_dict(
        {"problem": [p.prompt for p in problems], "solution": [p.answer for p in problems]}
    ).save_to_disk(str(data))
    return checkpoint, data


def heldout_file(folder: Path, problems: int = 8) -> Path:
    """A held-out set as a JSON Lines file with the dataset's columns (``problem``,
    ``solution``): problems of another seed than the training prompts'."""
    rows = ArithmeticTask(ArithmeticConfig.level(1, seed=6)).problems(problems, 0)
    path = folder / "heldout.jsonl"
    path.write_text(
        "".join(json.dumps({"problem": p.prompt, "solution": p.answer}) + "\n" for p in rows)
    )
    return path


def check_evaluation(result, step: int, problems: int, samples: int) -> None:
    """One held-out evaluation, at ``step``: in its step record, the summary and each
    tracker (read back with the library's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.staleflow.tracking import wandb_records

    (rec,) = [r for r in result.records if r.eval_mean_at_k is not None]
    assert rec.step == step, rec
    assert (rec.eval_problems, rec.eval_samples, rec.eval_k) == (problems, samples, samples)
    # rewards are 0 or 1: a problem's share right is at most its pass@n
    assert 0.0 <= rec.eval_mean_at_k <= rec.eval_pass_at_k <= 1.0, rec
    assert 0 <= rec.eval_version <= rec.eval_version_max <= step, rec
    flat = rec.to_flat()
    for evaluation in (result.summary.eval_last, result.summary.eval_best):
        assert evaluation is not None and evaluation["step"] == step
        assert evaluation["mean_at_k"] == flat["eval/mean_at_k"]
    run = result.run_dir
    events = EventAccumulator(str(run / "tracking" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass_at_k")] == [step]
    history = wandb_records.history(wandb_records.run_file(run / "tracking" / "wandb"))
    assert [h["_step"] for h in history if "eval/mean_at_k" in h] == [step]


def check_user_inputs(result, steps: int) -> None:
    """The template is recorded with the run; each tracker holds every step (read back
    with the library's reader) and the summary; the final policy loads with
    ``from_pretrained`` and generates what the run's own loader's model generates."""
    import torch
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from staleflow.models.checkpoint import load_pretrained
    from tests.staleflow.tracking import wandb_records

    run = result.run_dir
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert (data["chat_template"], data["system_prompt"]) == (True, "0")
    assert result.summary.chat_template == TEMPLATE
    assert json.loads((run / "summary.json").read_text())["chat_template"] == TEMPLATE

    events = EventAccumulator(str(run / "tracking" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("time/elapsed_s")] == list(range(1, steps + 1))
    assert [e.value for e in events.Scalars("summary/steps")] == [steps]

    path = wandb_records.run_file(run / "tracking" / "wandb")
    assert [h["_step"] for h in wandb_records.history(path)] == list(range(1, steps + 1))
    assert wandb_records.summary(path)["steps"] == steps
    assert wandb_records.config(path)["data"]["chat_template"] is True

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "tracking" / "mlruns").as_uri())
    (mlrun,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments() if e.name == "staleflow"]
    )
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == run.name
    history = client.get_metric_history(mlrun.info.run_id, "time.elapsed_s")
    assert [m.step for m in history] == list(range(1, steps + 1))
    assert mlrun.data.params["data.prompt_column"] == "problem"

    # the final policy, as a user of transformers loads it
    model, tokenizer = load_pretrained(run / "checkpoint")
    loaded = AutoModelForCausalLM.from_pretrained(run / "checkpoint", local_files_only=True)
    ids = torch.tensor([tokenizer.encode("0:3+4=", add_bos=True).tolist()])
    kwargs = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    with torch.no_grad():
        ours = model.eval().generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        theirs = loaded.eval().generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert theirs.tolist() == ours.tolist()
