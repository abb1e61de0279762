"""Environments written for `verifiers` (prime-rl's environment library, ``verifiers.v1``),
run under StaleFlow's environment contract (:mod:`staleflow.envs.base`).

A ``verifiers`` environment is a :class:`~verifiers.v1.Taskset` of :class:`~verifiers.v1.Task`
s: each task's data (``TaskData``: the prompt, a system prompt, its ground truth), the
tool servers it plays with (``Toolset`` classes whose ``@vf.tool`` methods the model
calls), its ``@vf.stop`` conditions over the trace, and its rubric (``@vf.reward``
methods and plugged ``RewardFunctionConfig`` functions, weighted and summed into
``trace.reward``; ``@vf.metric`` methods recorded beside it). In ``verifiers`` an *agent
harness* plays a task: a chat program that calls the model through an HTTP endpoint
and the tools through MCP, in a loop that ends at the first reply without a tool call.

Here StaleFlow is that harness, token in, token out: its engine generates each turn,
and this adapter does what the harness's chat loop does between turns, in process and
with the library's own code:

- ``start``: the task is built from the dataset row (``TaskData`` validated from the
  row's prompt, answer and columns); the first messages are its system prompt and
  prompt; the tools are every toolset's ``@vf.tool`` methods as the library's MCP
  server lists them, named ``<server>_<tool>`` as the harness names them;
- ``step``: the turn's tool calls (Hermes / Qwen ``<tool_call>`` format) go to those
  tools through the library's MCP server (``MCPServer.call_tool``, the same argument
  validation and result conversion); each result becomes a tool message; a turn
  without a tool call ends the episode, as it ends the harness's loop; ``Trace``-typed
  ``@vf.stop`` conditions run after each turn, as the library runs them;
- ``score``: the conversation becomes a ``Trace`` and the task scores it
  (``Task.score(trace)``, no runtime: the library's own offline path, which skips the
  signals that need a sandbox); the reward is ``trace.reward``.

**Rollout state** (a task typed with a ``State`` subclass, ``Task[Data, MyState, ...]``,
and toolsets that read and write ``self.state``): in ``verifiers`` the rollout keeps it as
``trace.state`` and serves it to the tool servers over an HTTP channel, which each
``@vf.tool`` call pulls before it runs and pushes after (``ServerBase._with_state``).
Here the trajectory keeps it (``state["tool_state"]``, the task state's JSON), and the
adapter is that channel: it hands each toolset the JSON, validated into the toolset's
state type, and takes its pushed copy back, validated into the task's, as the
rollout's channel handlers do. ``@vf.stop`` and the rubric read it as ``trace.state``.

The state is plain data (the task's data, the conversation and the rollout state as
JSON), so it travels with the trajectory like any environment's, through migration,
checkpoints and a resume. What is not supported is refused when the environment is
built, by name: a toolset whose state type the task's state is not (the one channel
carries one state), and tasks that need a container or a sandbox runtime to score
(``NEEDS_CONTAINER``). Multi-agent ``Env.run`` programs (an
environment that drives the model itself, awaiting its turns) are not this contract's
shape: StaleFlow's turns come from its engine, so only the single-agent case, the one
every plain taskset runs as (``SingleAgentEnv``), is adapted.

``verifiers`` is an optional dependency (``pip install 'staleflow[envs]'``); it is
imported only when such an environment is built.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from staleflow.envs.base import EnvContractError, EnvSample, EnvState, Episode, ModelTurn, Step
from staleflow.envs.tool_calls import ToolCall, ToolCallError, parse_tool_calls

if TYPE_CHECKING:
    from verifiers.v1 import Task, TaskData, Taskset
    from verifiers.v1.mcp.toolset import Toolset

T = TypeVar("T")
# the rollout state of the step running in this context: {"state": the task state's JSON}
_CHANNEL: ContextVar[dict[str, Any]] = ContextVar("staleflow_verifiers_channel")

INSTALL_HINT = "pip install 'staleflow[envs]' (verifiers 0.4)"
_ROW_FIELDS = ("prompt", "answer", "idx")  # filled from the sample, never a column


def require_verifiers() -> Any:
    """``verifiers.v1``, or an ImportError that says how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            f"a verifiers environment needs the verifiers package: {INSTALL_HINT} ({exc})"
        ) from exc
    return vf


def is_verifiers_taskset(obj: object) -> bool:
    """``obj`` is a ``verifiers`` Taskset class or object. Cheap: it looks only when the
    module that defined ``obj`` has imported ``verifiers`` already."""
    import sys

    vf = sys.modules.get("verifiers.v1")
    if vf is None:
        return False
    taskset = vf.Taskset
    return isinstance(obj, taskset) or (isinstance(obj, type) and issubclass(obj, taskset))


def _run(coro: Coroutine[object, object, T]) -> T:
    """Run a coroutine of the library from a worker thread (each has no loop running)."""
    return asyncio.run(coro)


class VerifiersEnvironment:
    """A ``verifiers`` taskset as a StaleFlow :class:`~staleflow.envs.Environment`; see
    the module docstring.

    ``taskset``: a ``Taskset`` subclass (built with its config's defaults) or a
    configured ``Taskset`` object. ``columns`` (the dataset fields each row must hold)
    defaults to the task data's required fields besides the prompt and the answer."""

    def __init__(
        self, taskset: Taskset | type[Taskset], *, columns: Sequence[str] | None = None
    ) -> None:
        vf = require_verifiers()
        from verifiers.v1.utils.generic import concrete_type

        if isinstance(taskset, type):
            config_type = concrete_type(taskset, vf.TasksetConfig, origin=vf.Taskset)
            try:
                taskset = taskset((config_type or vf.TasksetConfig)())
            except Exception as exc:
                raise EnvContractError(
                    f"verifiers taskset {taskset.__name__} cannot be built with its config's "
                    f"defaults ({exc!r}): name a factory that returns "
                    "VerifiersEnvironment(YourTaskset(YourConfig(...)))"
                ) from exc
        self.taskset = taskset
        self.task_type: type = type(taskset).task_type()
        self.data_type: type = self.task_type.data_type()
        self.name = f"verifiers:{type(taskset).__name__}"
        if self.task_type.NEEDS_CONTAINER:
            raise EnvContractError(
                f"{self.name}: its tasks need a container (NEEDS_CONTAINER), which this "
                "adapter does not provide; run tasks that score without a runtime"
            )
        fields = self.data_type.model_fields
        required = [n for n, f in fields.items() if f.is_required() and n not in _ROW_FIELDS]
        self.columns = tuple(required if columns is None else columns)
        self._has_answer = "answer" in fields
        self._shared = list(type(taskset).toolsets(taskset.config))
        per_task = self.task_type.toolsets(taskset.config.task)
        from pydantic import TypeAdapter
        from verifiers.v1.state import state_cls

        self.state_type: type = state_cls(self.task_type)
        self._state_adapter = TypeAdapter(self.state_type)
        for toolset in (*self._shared, *per_task):
            state_type = toolset._state_cls
            if not issubclass(self.state_type, state_type):
                raise EnvContractError(
                    f"{self.name}: toolset {type(toolset).__name__} keeps rollout state "
                    f"{state_type.__name__}, but the task keeps {self.state_type.__name__}: "
                    f"type the task with it (Task[Data, {state_type.__name__}, Config])"
                )
        self._stops = self._trace_stops()
        self.tools, self._owner = _run(self._list_tools(per_task))

    # --- the contract ------------------------------------------------------------

    def start(self, sample: EnvSample, seed: int) -> Episode:
        data = self._data(sample)
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        messages.append({"role": "user", "content": data.prompt_text})
        state: EnvState = {
            "data": data.model_dump(mode="json", exclude_none=True),
            "messages": messages,  # type: ignore[dict-item]
        }
        if self.state_type is not require_verifiers().State:
            state["tool_state"] = self.state_type().model_dump(mode="json")
        return Episode(tuple(messages), tuple(self.tools), state)

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        messages = list(state["messages"])  # type: ignore[arg-type]
        text = turn.text
        try:
            calls = parse_tool_calls(text)
        except ToolCallError as exc:
            # the harness answers a call it cannot read with an error and goes on
            messages.append({"role": "assistant", "content": text})
            error = f"error: {exc}"
            messages.append({"role": "user", "content": error})
            return Step(
                {**state, "messages": messages},  # type: ignore[dict-item]
                observation=error,
                error=f"turn {turn.index}: {exc}",
                info={"tool_errors": 1},
            )
        content = text.split("<tool_call>", 1)[0].strip()
        wire_calls = [
            {"id": f"call_{turn.index}_{i}", "name": c.name, "arguments": json.dumps(c.arguments)}
            for i, c in enumerate(calls)
        ]
        assistant: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
        if wire_calls:
            assistant["tool_calls"] = wire_calls
        messages.append(assistant)
        if not calls:  # a reply without a tool call ends the harness's loop
            after = {**state, "messages": messages}
            return Step(after, done=True, info=self._stopped_info(after))  # type: ignore[arg-type]
        data = self._task(state).data
        channel = {"state": state.get("tool_state")}  # what the toolsets pull and push
        results, errors = _run(self._call_tools(data, calls, channel))
        for call, result in zip(wire_calls, results, strict=True):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": call["name"],
                    "content": result,
                }
            )
        after: EnvState = {**state, "messages": messages}  # type: ignore[dict-item]
        if "tool_state" in state:
            after["tool_state"] = channel["state"]
        stopped = self._stopped(after)
        info: dict[str, int | float | str] = {"tool_calls": len(calls), "tool_errors": len(errors)}
        if stopped:
            info["stop"] = stopped
        return Step(
            after,
            observation="\n".join(results),
            done=bool(stopped),
            error="; ".join(errors)[:500],
            info=info,
        )

    def score(self, state: EnvState) -> float:
        task = self._task(state)
        trace = self._trace(task, state)
        _run(task.score(trace))
        return float(trace.reward)

    # --- the library's pieces ----------------------------------------------------

    def _data(self, sample: EnvSample) -> TaskData:
        row: dict[str, Any] = {"prompt": sample.prompt, "idx": sample.sample_id}
        if self._has_answer:
            row["answer"] = sample.answer
        row.update(sample.extra)
        try:
            data = self.data_type.model_validate(row)
        except Exception as exc:  # pydantic's message names the field
            raise EnvContractError(
                f"{self.name}: the row is not a {self.data_type.__name__}: {exc}"
            ) from exc
        # the taskset config's system prompt file overrides each task's, as its __iter__ does
        override = self.taskset.system_prompt
        return data if override is None else data.model_copy(update={"system_prompt": override})

    def _task(self, state: EnvState) -> Task:
        data = self.data_type.model_validate(state["data"])
        return self.task_type(data, self.taskset.config.task)

    def _trace(self, task: Task, state: EnvState) -> Any:
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

        kinds = {
            "system": SystemMessage,
            "user": UserMessage,
            "assistant": AssistantMessage,
            "tool": ToolMessage,
        }
        vf = require_verifiers()
        nodes = []
        for i, message in enumerate(state["messages"]):  # type: ignore[union-attr]
            kind = kinds[message["role"]]  # type: ignore[index]
            nodes.append(
                MessageNode(
                    parent=i - 1 if i else None,
                    message=kind.model_validate(message),
                    sampled=kind is AssistantMessage,
                    tools=[vf.Tool(**t["function"]) for t in self.tools] if i == 0 else [],
                )
            )
        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
            is_completed=True,
            ok=True,
        )
        if "tool_state" in state:  # the rollout state the rubric and stops read
            trace.state = self._state_adapter.validate_python(state["tool_state"])
        return trace

    def _trace_stops(self) -> list[Any]:
        from verifiers.v1.session import hook_boundary

        vf = require_verifiers()
        # a task without data, only to list its hooks (which read its config, not its data)
        probe = self.task_type.__new__(self.task_type)
        probe.config = self.taskset.config.task
        stops = []
        for fn in self.task_type.hooks(probe, "stop"):
            if hook_boundary(fn, allow_trace=True) is not vf.Trace:
                raise EnvContractError(
                    f"{self.name}: @vf.stop {fn.__name__} reads a model Request or Response, "
                    "which StaleFlow's engine never builds; stop on the Trace instead"
                )
            stops.append(fn.__name__)
        return stops

    def _stopped(self, state: EnvState) -> str:
        """The first ``Trace`` stop condition that holds after this turn ('' if none)."""
        if not self._stops:
            return ""
        from verifiers.v1.session import call_hook

        vf = require_verifiers()
        task = self._task(state)
        trace = self._trace(task, state)
        hooks = {fn.__name__: fn for fn in task.hooks("stop")}

        async def check() -> str:
            for name in self._stops:
                if await call_hook(hooks[name], {vf.Trace: trace}) is True:
                    return name
            return ""

        return _run(check())

    def _stopped_info(self, state: EnvState) -> dict[str, int | float | str]:
        stopped = self._stopped(state)
        return {"stop": stopped} if stopped else {}

    async def _servers(self, toolsets: Sequence[Any], data: TaskData | None) -> dict[str, Any]:
        """Each toolset registered on an in-process MCP server, as ``verifiers`` serves it:
        ``setup()``, then (per-task toolsets) ``setup_task(data)``, then ``register``;
        its state channel is this call's (``_CHANNEL``)."""
        from mcp.server.mcpserver import MCPServer

        servers: dict[str, Any] = {}
        for toolset in toolsets:
            self._connect(toolset)
            await toolset.setup()
            if data is not None:
                await toolset.setup_task(data)
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            servers[toolset.server_name] = server
        return servers

    async def _list_tools(
        self, per_task: Sequence[Any]
    ) -> tuple[list[dict[str, Any]], dict[str, tuple[bool, str, str]]]:
        schemas: list[dict[str, Any]] = []
        owner: dict[str, tuple[bool, str, str]] = {}  # full name -> (shared?, server, tool)
        for shared, toolsets in ((True, self._shared), (False, per_task)):
            for server_name, server in (await self._servers(toolsets, None)).items():
                for tool in await server.list_tools():
                    full = f"{server_name}_{tool.name}" if server_name else tool.name
                    if full in owner:
                        raise EnvContractError(
                            f"{self.name}: two toolsets offer a tool named {full!r}"
                        )
                    owner[full] = (shared, server_name, tool.name)
                    schemas.append(
                        {
                            "type": "function",
                            "function": {
                                "name": full,
                                "description": tool.description or "",
                                "parameters": tool.input_schema,
                            },
                        }
                    )
        return schemas, owner

    def _connect(self, toolset: Toolset) -> None:
        """Be ``toolset``'s state channel, as the rollout's is (its GET dumps the task's
        state, its PUT validates the pushed copy into the task's state type). The channel
        is the running step's (a context variable: a shared toolset serves steps of
        several trajectories at once, on the stage's threads)."""
        mine = toolset._state_adapter

        async def pull() -> Any:
            return mine.validate_python(_CHANNEL.get()["state"])

        async def push(before: bytes) -> None:
            pushed = self._state_adapter.validate_json(mine.dump_json(toolset.state))
            _CHANNEL.get()["state"] = pushed.model_dump(mode="json")

        toolset._pull_state, toolset._push_state = pull, push

    async def _call_tools(
        self, data: TaskData, calls: Sequence[ToolCall], channel: dict[str, Any]
    ) -> tuple[list[str], list[str]]:
        """Each call's result text, and the errors (an unknown tool, a tool that raised
        or refused its arguments): the model reads them as the result, as it would from
        the harness."""
        from mcp.server.mcpserver.exceptions import ToolError

        _CHANNEL.set(channel)  # this step's task: the toolsets' pulls and pushes read it
        shared = await self._servers(self._shared, None)
        per_task = await self._servers(self.task_type.toolsets(self.taskset.config.task), data)
        results, errors = [], []
        for call in calls:
            if call.name not in self._owner:
                text = f"error: unknown tool {call.name!r}"
                results.append(text)
                errors.append(text)
                continue
            is_shared, server_name, tool = self._owner[call.name]
            server = (shared if is_shared else per_task)[server_name]
            try:
                result = await server.call_tool(tool, dict(call.arguments))
            except ToolError as exc:
                text = f"error: {exc}"
                results.append(text)
                errors.append(f"{call.name}: {exc}")
                continue
            results.append(_result_text(result))
            if getattr(result, "is_error", False):
                errors.append(f"{call.name}: {results[-1][:200]}")
        return results, errors


def _result_text(result: object) -> str:
    """An MCP tool result as the text the model reads (text blocks joined by newlines,
    as the harness joins them; other blocks as their repr)."""
    blocks = getattr(result, "content", None) or []
    parts = [b.text if getattr(b, "type", "") == "text" else str(b) for b in blocks]
    return "\n".join(parts) if parts else str(result)


def verifiers_environment(
    taskset: Taskset | type[Taskset], *, columns: Sequence[str] | None = None
) -> VerifiersEnvironment:
    """A factory for ``env.name=module:attribute``: ``taskset`` as an environment."""
    return VerifiersEnvironment(taskset, columns=columns)


__all__ = [
    "INSTALL_HINT",
    "VerifiersEnvironment",
    "is_verifiers_taskset",
    "require_verifiers",
    "verifiers_environment",
]
