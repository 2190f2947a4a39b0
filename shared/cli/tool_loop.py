"""Tool-calling conversations through the queue: `actq gsm8k --mode with-tools` and `actq
run-file` lines with `tools` run on this.

A conversation is a loop of jobs, one per turn, up to `max_turns`: turn t sends the conversation
so far with the tools; when the job's result has `tool_calls`, each call is answered here (the
calculator, shared/calculator.py, is the only tool actq can answer; a call to any other name gets
an error result) and the assistant message with its calls, then one `tool` message per call, are
appended for turn t + 1. A turn without calls is the final answer; a failed turn, or calls at the
last allowed turn, end the conversation too (`ended`: "answer", "turn_limit" or "failed").

Conversations run side by side: every conversation's next turn is submitted as soon as its last
one ended, so many are in flight at once and the worker batches them, while each stays sequential.

Results directory (on batch.py's BatchRun: run.json, jobs.json, samples/, summary.json), plus:
  trajectories/<n>.jsonl   one line per turn, rewritten whole after each turn: the messages
                           sent, the job id and status, the result's text, content, tool_calls,
                           tool_call_problems, finish_reason and usage, the tool results fed back
                           (`tool_results`), the activations manifest (and file, with --download:
                           activations/<n>.turn<t>.safetensors)
  jobs.json                "<n>:turn<t>" -> job id

Each turn's job carries the run's capture and, as metadata, the run id, the item and the turn
(`actq_run`, `<item_name>`, `turn`: GET /jobs and `actq export --jobs` find them). Its
idempotency key is derived from the run id, the item and the turn. Resuming reads each
trajectory and continues at its next turn: the request is built again from the recorded turns,
identical to the one sent before, so a turn that was queued but not recorded when the run was
stopped is returned by its key, not queued twice, and a recorded turn is never submitted again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

from shared.calculator import TOOL, TOOL_NAME, calculate_arguments
from shared.cli import batch
from shared.client import BadRequest, Client, Job
from shared.listing import RUN_KEY

MAX_TURNS_DEFAULT = 4
TRAJECTORIES = "trajectories"
ENDINGS = ("answer", "turn_limit", "failed")


@dataclass
class Conversation:
    """One item of a tool run: `key` names its files (samples/<key>.json, trajectories/<key>.jsonl);
    `messages` is the conversation before the first turn; `request` the job's other fields (model,
    tools, tool_choice, max_tokens, capture...), the same at every turn; `data` the layer's own."""

    key: int
    messages: list[dict[str, Any]] | None  # None: a raw `prompt` in `request`, one turn without tools
    request: dict[str, Any]
    data: Any = None


def answer_call(call: dict[str, Any]) -> dict[str, Any]:
    """The tool result of one call (OpenAI's shape, as the job result holds it): the calculator's
    answer, value or error; for a name that is not the calculator, an error saying which tool
    there is. `content` is what the model is fed back."""
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments", "")
    if name != TOOL_NAME:
        content = f"error: there is no tool named {name!r}; the only tool is {TOOL_NAME}"
        return {"tool_call_id": call.get("id"), "name": name, "arguments": arguments, "content": content, "ok": False}
    result = calculate_arguments(arguments)
    return {
        "tool_call_id": call.get("id"),
        "name": name,
        "arguments": arguments,
        "content": result.text,
        "ok": result.ok,
    }


def next_messages(conversation: Conversation, turns: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages turn len(turns) sends: the conversation, then for each earlier turn the
    assistant's message (its text outside the calls, when there is any, and the calls) and one
    tool message per call with its result. None for a raw prompt."""
    if conversation.messages is None:
        return None
    messages = [dict(m) for m in conversation.messages]
    for turn in turns:
        assistant: dict[str, Any] = {"role": "assistant", "tool_calls": turn["tool_calls"]}
        if turn.get("content"):
            assistant["content"] = turn["content"]
        messages.append(assistant)
        messages += [
            {"role": "tool", "tool_call_id": r["tool_call_id"], "content": r["content"]} for r in turn["tool_results"]
        ]
    return messages


def ended(turns: list[dict[str, Any]], max_turns: int) -> str | None:
    """Why the conversation is over ("answer", "turn_limit", "failed"), or None: a next turn is due."""
    if not turns:
        return None
    last = turns[-1]
    if last["status"] != "succeeded":
        return "failed"
    if not last.get("tool_calls"):
        return "answer"
    return "turn_limit" if len(turns) >= max_turns else None


def turn_request(
    conversation: Conversation, turns: list[dict[str, Any]], run_id: str, item_name: str, label: str | None = None
) -> dict:
    """The job of the conversation's next turn: the same fields every turn (but a `required`
    tool_choice, which holds for the first turn only: later turns are "auto"), the messages so
    far, and metadata naming the run (its id, and its label as `run`), the item and the turn."""
    metadata = {"actq_run": run_id, item_name: str(conversation.key), "turn": str(len(turns))}
    if label is not None:
        metadata[RUN_KEY] = label
    messages = next_messages(conversation, turns)
    request = conversation.request
    if turns and request.get("tool_choice") == "required":  # forced at the first turn only, or it never ends
        request = {**request, "tool_choice": "auto"}
    return {**request, **({} if messages is None else {"messages": messages}), "metadata": metadata}


def turn_record(turn: int, messages: list[dict[str, Any]] | None, job: Job, activations: dict) -> dict[str, Any]:
    """One line of trajectories/<n>.jsonl for a turn whose job ended; the calls it made are
    answered here (`tool_results`)."""
    result = batch.job_result(job)
    calls = (result.get("tool_calls") or []) if job.data["status"] == "succeeded" else []
    usage = result.get("usage") or {}
    return {
        "turn": turn,
        "messages": messages,
        "job_id": job.id,
        "status": job.data["status"],
        "error": job.data.get("error"),
        "text": result.get("text"),
        "content": result.get("content"),
        "tool_calls": calls,
        "tool_call_problems": result.get("tool_call_problems"),
        "tool_results": [answer_call(call) for call in calls],
        "finish_reason": result.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "completion_span": result.get("completion_span"),
        **activations,
    }


def final_text(turns: list[dict[str, Any]]) -> str:
    """The conversation's answer: the last turn's text when it made no calls; its text outside
    the calls when it still called a tool at the turn limit; "" when it failed."""
    last = turns[-1]
    if last["status"] != "succeeded":
        return ""
    return (last.get("content") or "") if last.get("tool_calls") else (last.get("text") or "")


def sample_fields(key: int, turns: list[dict[str, Any]], max_turns: int) -> dict[str, Any]:
    """What a tool run's sample says of its conversation. The job fields (`job_id`, `status`,
    `prompt_tokens`, `completion_tokens`, `activations`...) are the last turn's, the job whose
    text is scored (and the one `actq probe` reads by default); `turn_jobs` lists every turn's
    job, for probes and exports over turns; `generated_tokens` counts every turn's tokens."""
    last = turns[-1]
    keep = (
        "job_id",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "activations",
        "activations_file",
    )
    return {
        "turns": len(turns),
        "tool_calls": sum(len(t["tool_calls"]) for t in turns),
        "tool_errors": sum(not r["ok"] for t in turns for r in t["tool_results"]),
        "ended": ended(turns, max_turns),
        "trajectory": f"{TRAJECTORIES}/{key}.jsonl",
        "text": final_text(turns),
        "status": "succeeded" if all(t["status"] == "succeeded" for t in turns) else last["status"],
        "error": last.get("error"),
        **{k: last.get(k) for k in keep if k != "status"},
        "generated_tokens": sum(t.get("completion_tokens") or 0 for t in turns),
        "turn_jobs": [
            {
                "turn": t["turn"],
                **{k: t.get(k) for k in keep},
                "completion_span": t.get("completion_span"),
                "tool_calls": len(t["tool_calls"]),
            }
            for t in turns
        ],
    }


def summarize(samples: list[dict]) -> dict:
    """The tool part of summary.json: turns and tool calls per item and their totals and means,
    how the conversations ended."""
    per = {str(s.get("index")): {"turns": s.get("turns", 0), "tool_calls": s.get("tool_calls", 0)} for s in samples}
    n = len(samples)
    turns = sum(p["turns"] for p in per.values())
    calls = sum(p["tool_calls"] for p in per.values())
    return {
        "tools": {
            "turns": turns,
            "tool_calls": calls,
            "tool_errors": sum(s.get("tool_errors", 0) for s in samples),
            "turns_per_item_mean": round(turns / n, 4) if n else None,
            "tool_calls_per_item_mean": round(calls / n, 4) if n else None,
            "items_calling_tools": sum(p["tool_calls"] > 0 for p in per.values()),
            "ended": {e: sum(s.get("ended") == e for s in samples) for e in ENDINGS},
            "per_item": per,
        }
    }


class Trajectories:
    """trajectories/<n>.jsonl of a results directory."""

    def __init__(self, out: Path) -> None:
        self.folder = out / TRAJECTORIES

    def read(self, key: int) -> list[dict[str, Any]]:
        path = self.folder / f"{key}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def write(self, key: int, turns: list[dict[str, Any]]) -> None:
        """Whole or not at all (a temp file, then a rename), so a stopped run leaves every turn or none."""
        batch.write_text(self.folder / f"{key}.jsonl", "".join(json.dumps(t, allow_nan=False) + "\n" for t in turns))


Record = Callable[[Conversation, list[dict[str, Any]], Job], dict]


@dataclass
class _State:
    conversation: Conversation
    turns: list[dict[str, Any]]


def execute(
    client: Client,
    run: batch.BatchRun,
    conversations: list[Conversation],
    record: Record,
    *,
    max_turns: int,
    item_name: str,
    download: bool = False,
    unit: str = "item",
    summarize_more: Callable[[list[dict]], dict] = lambda _: {},
    quiet: bool = False,
) -> dict:
    """Run every conversation without a sample to its end, `record` each (its turns and the last
    turn's job; the sample, with a `status`) and write the results; summary.json adds
    `summarize`'s tool figures and `summarize_more`'s. Ctrl-C leaves a consistent directory and is
    re-raised as KeyboardInterrupt."""

    def extra(samples: list[dict]) -> dict:
        return {**summarize(samples), **summarize_more(samples)}

    with batch.interrupt_flag() as interrupted, batch.retries_interrupted(client, interrupted):
        started = time.monotonic()
        try:
            _Loop(client, run, record, max_turns, item_name, download, interrupted).run(conversations, unit, quiet)
        except KeyboardInterrupt:
            if run.saved:
                run.finish(time.monotonic() - started, False, len(conversations), unit, extra)
            batch.raise_interrupted(client, [run])
        return run.finish(time.monotonic() - started, True, len(conversations), unit, extra)


class _Loop:
    """One pass of `execute`: conversations due a turn are submitted together, ended jobs recorded."""

    def __init__(
        self,
        client: Client,
        results: batch.BatchRun,
        record: Record,
        max_turns: int,
        item_name: str,
        download: bool,
        interrupted: threading.Event,
    ) -> None:
        self.client, self.results, self.record = client, results, record
        self.max_turns, self.item_name, self.download, self.interrupted = max_turns, item_name, download, interrupted
        self.trajectories = Trajectories(results.out)

    def run(self, conversations: list[Conversation], unit: str, quiet: bool) -> None:
        done = self.results.done()
        states = [_State(c, self.trajectories.read(c.key)) for c in conversations if c.key not in done]
        bar = tqdm(total=len(conversations), initial=len(conversations) - len(states), unit=unit, disable=quiet)
        counts = {"in_flight": 0, "turns": 0, "tool_calls": 0, "succeeded": 0, "failed": 0}
        try:
            due = []
            for state in states:
                if ended(state.turns, self.max_turns) is None:
                    due.append(state)
                else:  # every turn recorded before the run stopped: only its sample is missing
                    last = state.turns[-1]
                    job = self.client.job(last["job_id"]) if last["job_id"] else self._refused(last["error"])
                    self._finish(state, job, counts, bar)
            pending: list[tuple[_State, Job]] = []
            while due or pending:
                if self.interrupted.is_set():
                    raise KeyboardInterrupt
                refused: list[tuple[_State, Job]] = []
                if due:
                    accepted, refused = self._submit(due)
                    pending += accepted
                    due = []
                counts["in_flight"] = len(pending)
                bar.set_postfix(counts, refresh=True)
                finished = refused
                if pending:
                    pending, polled = self._poll(pending)
                    finished += polled
                for state, job in finished:
                    messages = next_messages(state.conversation, state.turns)
                    turn = len(state.turns)
                    name = f"{state.conversation.key}.turn{turn}.safetensors"
                    state.turns.append(
                        turn_record(turn, messages, job, self.results.download(job, name, self.download))
                    )
                    self.trajectories.write(state.conversation.key, state.turns)
                    counts["turns"] += 1
                    counts["tool_calls"] += len(state.turns[-1]["tool_calls"])
                    if ended(state.turns, self.max_turns) is None:
                        due.append(state)
                    else:
                        self._finish(state, job, counts, bar)
        finally:
            bar.close()

    def _submit(self, due: list[_State]) -> tuple[list[tuple[_State, Job]], list[tuple[_State, Job]]]:
        """Queue the next turn of each conversation: (accepted, refused). A first turn the API
        refuses stops the run (its request is the command's: the command must change), as
        batch.py does; a later turn it refuses (what the model wrote made a conversation the API
        will not take) ends that conversation with a failed turn that has no job, and the run goes on."""
        run = self.results
        requests = [turn_request(s.conversation, s.turns, run.run_id, self.item_name, run.label) for s in due]
        parts = [f"turn{len(s.turns)}" for s in due]
        keys = [run.idempotency_key(s.conversation.key, part) for s, part in zip(due, parts, strict=True)]
        accepted: list[tuple[_State, Job]] = []
        refused: list[tuple[_State, Job]] = []
        for start in range(0, len(due), batch.SUBMIT_CHUNK):
            chunk = list(range(start, min(start + batch.SUBMIT_CHUNK, len(due))))
            try:
                jobs = self.client.submit_many([requests[i] for i in chunk], idempotency_keys=[keys[i] for i in chunk])
            except BadRequest:
                if all(not due[i].turns for i in chunk):
                    raise
                jobs = []
                for i in chunk:  # one by one: the refused ones are known, the others go on
                    try:
                        jobs += self.client.submit_many([requests[i]], idempotency_keys=[keys[i]])
                    except BadRequest as exc:
                        if not due[i].turns:
                            raise
                        message = f"the API refused this turn's request: {exc.detail}"
                        jobs.append(self._refused({"type": "refused", "message": message}))
            run.save()  # the API accepted them: from now on the run is resumable
            for i, job in zip(chunk, jobs, strict=True):
                if job.id:
                    run.jobs[run.job_key(due[i].conversation.key, parts[i])] = job.id
                    accepted.append((due[i], job))
                else:
                    refused.append((due[i], job))
            batch.write_json(run.out / "jobs.json", dict(sorted(run.jobs.items())))
        return accepted, refused

    def _refused(self, error: dict) -> Job:
        """A turn the API refused, as a failed job without an id (recorded with job_id "")."""
        return Job(self.client, {"id": "", "status": "failed", "error": error})

    def _poll(self, pending: list[tuple[_State, Job]]) -> tuple[list[tuple[_State, Job]], list[tuple[_State, Job]]]:
        """Long-poll the oldest job, then look at those behind it (up to LOOKAHEAD unfinished):
        (still pending, ended)."""
        head = pending[0][1].refresh(wait=2)
        finished, unfinished = [], 0
        for state, job in pending:
            if unfinished >= batch.LOOKAHEAD:
                break
            if job is not head:
                job.refresh()
            if job.done:
                finished.append((state, job))
            else:
                unfinished += 1
        ended_ids = {job.id for _, job in finished}
        return [(s, j) for s, j in pending if j.id not in ended_ids], finished

    def _finish(self, state: _State, last: Job, counts: dict, bar: tqdm) -> None:
        sample = self.record(state.conversation, state.turns, last)
        self.results.write_sample(state.conversation.key, sample)
        counts["succeeded" if sample["status"] == "succeeded" else "failed"] += 1
        bar.update(1)


def calculator_tools() -> list[dict[str, Any]]:
    """The tools every turn of a with-tools GSM8K run sends: the calculator, exactly as defined."""
    return [TOOL]
