"""Starting and stopping one ``sglang.launch_server`` per rollout instance.

The argv comes from :class:`ServerSpec`; the server's output goes to a log file (in the run
folder under launch); :meth:`SGLangServer.start` waits until ``GET /health`` answers 200
(SGLang 0.5.23 ``srt/entrypoints/http_server.py:721``: 503 while starting) and fails with
the log's tail if the process exits first or the wait times out; :meth:`SGLangServer.stop`
terminates the whole process group (the server forks scheduler and detokenizer processes).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.engines.sglang.http import SGLangError, SGLangHTTP
from staleflow.engines.sglang.loader import LOADER_PATH

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to run one server. ``extra_args`` is appended verbatim (shell-split)."""

    model_path: str
    log_path: str
    tp_size: int = 1
    mem_fraction_static: float | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    python: str = ""  # the interpreter with sglang installed ("": this one)
    extra_args: str = ""
    # --enable-deterministic-inference: tokens drawn from (request seed, position) with
    # batch-invariant kernels, slower (the SGLang adapter's class doc).
    deterministic: bool = False
    startup_timeout_s: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    # "cuda", "cpu", or "auto": cpu where this process's torch sees no CUDA device. On
    # CPU SGLang needs its kernel package's CPU build (sgl_kernel), SGLANG_USE_CPU_ENGINE
    # and an attention backend without CUDA kernels (docs/engines.md).
    device: str = "auto"
    # --dtype of the weights and activations; "" = SGLang's "auto", which serves a float32
    # checkpoint in float16 (logprobs then differ from a float32 trainer's by ~3e-4 on the
    # tiny test model)
    dtype: str = ""
    # LoRA (trainer.lora): adapters up to this rank on these modules, loaded per version
    # with /load_lora_adapter; two at a time (the next one is loaded before the last goes)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    def on_cpu(self) -> bool:
        if self.device == "auto":
            import torch

            return not torch.cuda.is_available()
        return self.device == "cpu"

    def argv(self, port: int) -> list[str]:
        # Flags of SGLang 0.5.23's ServerArgs (srt/arg_groups/fields/*.py).
        argv = [
            self.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
            "--skip-tokenizer-init",  # requests and answers are token ids
            # our PS loader may run inside /update_weights_from_tensor (model.py:292)
            "--custom-weight-loader",
            LOADER_PATH,
        ]
        if self.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.deterministic:
            argv.append("--enable-deterministic-inference")  # arg_groups/fields/exec_.py:1153
        if self.dtype:
            argv += ["--dtype", self.dtype]
        if self.lora_rank:  # arg_groups/fields/lora.py
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)]
            argv += ["--lora-target-modules", *self.lora_targets]
            argv += ["--max-loras-per-batch", "2", "--max-loaded-loras", "2"]
        if self.on_cpu():
            # torch_native: SDPA attention in plain PyTorch (no FlashInfer/Triton kernels)
            argv += ["--device", "cpu", "--attention-backend", "torch_native"]
            argv += ["--disable-cuda-graph"]
            if self.lora_rank:  # the default csgmv LoRA kernels are Triton's
                argv += ["--lora-backend", "torch_native"]
        return argv + shlex.split(self.extra_args)


class SGLangServer:
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port = spec.port or _free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> SGLangServer:
        log = Path(self.spec.log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = self.spec.argv(self.port)
        logger.info("starting SGLang: %s (log %s)", shlex.join(argv), log)
        env = {**os.environ, **self.spec.env}
        if self.spec.on_cpu():
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's is_cpu() (srt/utils/common.py)
        # SGLang must report log_softmax(logits / T) (sampler.py:192-322): not the
        # pre-temperature logprobs this variable switches to.
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
        with log.open("ab") as out:
            self._process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        client = SGLangHTTP(self.url)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise SGLangError(
                    f"the SGLang server exited with code {code} while starting; its log "
                    f"({self.spec.log_path}) ends with:\n{self.log_tail()}"
                )
            if client.status("/health") == 200:
                return
            time.sleep(0.5)
        raise SGLangError(
            f"the SGLang server at {self.url} was not healthy after "
            f"{self.spec.startup_timeout_s:.0f} s; its log ({self.spec.log_path}) ends "
            f"with:\n{self.log_tail()}"
        )

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.spec.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 8.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the instance's process dies (a killed
    Ray actor runs no cleanup), so no server outlives its instance. Linux only."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
