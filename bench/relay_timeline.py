"""Where one request's time goes at c=1, in the order it goes: a copy of ``src/`` with trace points
patched in (each process appends ``time.monotonic_ns()`` and a name to a file of its own; the clock is
the same for every process on the machine), one coordinator + node stack (bench/relay_stack.py) in
front of the fixed-response upstream, wrk at c=1. Each request's points are read from the
coordinator's ASGI entry to the next request's, and the table gives, for the requests whose points
came in the commonest order, the median time of each point from the entry and from the point before.

relay_c1.py says how much CPU each process spends per request; this says where on the request's path
it is spent and where a process waits for another (a gap between a write and the other side's read is
the kernel and the reader's wake-up). "node: flushes its socket" is where queued frames leave; the node
also flushes on every read, so it shows just before "node: frame read" too. The points cost ~5 µs
each, so read the gaps, not the total.
A point whose line of code has moved fails the patch by name: update ``POINTS``.

Run: .venv/bin/python bench/relay_timeline.py [--path self|paid] [--seconds 4]
Everything listens on 127.0.0.1; the wrk run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_overhead import machine, tree_state  # noqa: E402
from bench.relay_stack import one_stack  # noqa: E402
from bench.wrk_load import run_wrk  # noqa: E402

_IMPORT = "from darkbloom._timeline import point; "
_COORDINATOR, _NODE = "coordinator/", "provider/"
# (file under src/darkbloom, text found once in it, the point's name): the point goes on a line of its
# own before the line where the text starts, at its indentation; a name ending in "+" goes after the
# line where the text ends instead (the "+" is dropped)
POINTS: list[tuple[str, str, str]] = [
    (_COORDINATOR + "http/routes/provider_ws.py", 'if scope["type"] == "websocket" and scope["path"] == PATH',
     "coordinator: HTTP request enters the app"),
    (_COORDINATOR + "http/routes/inference.py", "caller = await require_caller(request, services)", "authenticated+"),
    (_COORDINATOR + "inference/serving.py", "call = parse_call(await read_body(), edge)",
     "rates charged, before the body"),
    (_COORDINATOR + "inference/serving.py", "policy = route.resolve_policy(request.headers, caller)\n",
     "body read and parsed"),
    (_COORDINATOR + "inference/serving.py", "policy = await life.admit(policy, decision, bounds)", "placement decided"),
    (_COORDINATOR + "inference/serving.py", "admitted_at = time.monotonic()", "admitted+"),
    (_COORDINATOR + "inference/serving.py", "PLACEMENT_SECONDS.labels(policy.mode)", "slot claimed"),
    (_COORDINATOR + "inference/attempts.py", "session.open_inbox(self.request_id, self)", "attempt made"),
    (_COORDINATOR + "inference/attempts.py", "frame = dump(InferenceRequest(", "request sealed"),
    (_COORDINATOR + "inference/attempts.py", "self.sent = True", "frame made"),
    (_COORDINATOR + "fleet/connection.py", "await self.websocket.send_text(frame)",
     "coordinator: frame to the node written"),
    (_COORDINATOR + "websocket_protocol.py", "if self.handshake_complete and not self.close_sent and _at_frame_start",
     "coordinator: reads the node's socket"),
    (_COORDINATOR + "inference/attempts.py", "chunks = response_chunks(self.reply_key.open(envelope))",
     "chunk frame parsed"),
    (_COORDINATOR + "inference/serving.py", "first_content_at = attempt.first_content_at", "first content"),
    (_COORDINATOR + "inference/attempts.py", "if bounds is not None and (usage.prompt_tokens > bounds.prompt",
     "completion delivered"),
    (_COORDINATOR + "inference/serving.py", 'cost = await life.finish("ok")', "answer collected"),
    (_COORDINATOR + "inference/settlement.py", 'settled = await self._money("settlement"', "slots given back"),
    (_COORDINATOR + "money/ledger/sqlite.py", "state = _read(conn, steps)", "ledger's transaction begun"),
    (_COORDINATOR + "money/ledger/sqlite.py", "conn.execute(\"COMMIT\")", "ledger committed+"),
    (_COORDINATOR + "inference/settlement.py", "unused = admission.unused_token_charges(self.rate_charges, usage",
     "settlement back on the loop"),
    (_COORDINATOR + "inference/serving.py", "return JsonAnswer(presenter.response(", "settled"),
    (_COORDINATOR + "inference/settlement.py", "outcome, self._log_outcome = self._log_outcome, None",
     "coordinator: answer written"),
    (_NODE + "node.py", "frame = protocol.parse_coordinator_frame(raw)", "node: frame read"),
    (_NODE + "fleet_requests.py", "body, sealer = self._open_request(frame)", "node: request task runs"),
    (_NODE + "fleet_requests.py", 'model_id = body.get("model")', "node: request opened"),
    (_NODE + "backends/openai_upstream.py", "async with client.post(url, json=payload", "node: upstream called"),
    (_NODE + "backends/openai_upstream.py", "meter.prompt_tokens, meter.completion_tokens = estimate, 0",
     "node: upstream's head read"),
    (_NODE + "fleet_requests.py", "usage = job.report(relayed.prompt_tokens, relayed.completion_tokens)",
     "node: upstream's stream ended"),
    (_NODE + "outbox.py", "data = self.protocol.data_to_send()", "node: flushes its socket"),
]
_WRITER = '''import os
import time

_fd = None


def point(name):
    global _fd
    if _fd is None:
        _fd = os.open(f"{directory}/points.{{os.getpid()}}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(_fd, f"{{time.monotonic_ns()}} {{name}}\\n".encode())
'''


def traced_copy(directory: Path) -> Path:
    """``src/`` copied into ``directory`` with the trace points in; returns the copy's ``src``."""
    src = directory / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    package = src / "darkbloom"
    (package / "_timeline.py").write_text(_WRITER.format(directory=directory))
    for file, text, name in POINTS:
        path = package / file
        code = path.read_text()
        if code.count(text) != 1:
            raise SystemExit(f"{file}: the text of point {name!r} is not there once: {text!r}")
        found = code.index(text)
        after, name = name.endswith("+"), name.removesuffix("+")
        line_start = code.rfind("\n", 0, found) + 1
        indent = code[line_start:len(code) - len(code[line_start:].lstrip(" "))]
        at = code.index("\n", found + len(text.rstrip("\n"))) + 1 if after else line_start
        path.write_text(code[:at] + f"{indent}{_IMPORT}point({name!r})\n" + code[at:])
    return src


def timeline(directory: Path) -> str:
    events = sorted((int(stamp), name) for file in directory.glob("points.*")
                    for stamp, _, name in (line.partition(" ") for line in file.read_text().splitlines()))
    start = POINTS[0][2]
    requests: list[list[tuple[int, str]]] = []
    for stamp, name in events:
        if name == start:
            requests.append([])
        if requests:
            requests[-1].append((stamp, name))
    requests = requests[len(requests) // 5:-1]  # past the warm-up; the last may be cut short
    orders = Counter(tuple(name for _, name in request) for request in requests)
    order, count = orders.most_common(1)[0]
    alike = [request for request in requests if tuple(name for _, name in request) == order]
    periods = [b[0][0] - a[0][0] for a, b in zip(requests, requests[1:])]
    lines = [f"{len(requests)} requests, {count} with their points in the commonest order; from one request's "
             f"entry to the next's: median {statistics.median(periods) / 1000:.0f} µs\n",
             "| point | µs from the entry | µs after the point before |", "|---|---|---|"]
    for index, name in enumerate(order):
        at = statistics.median(request[index][0] - request[0][0] for request in alike) / 1000
        gap = statistics.median(request[index][0] - request[index - 1][0] for request in alike) / 1000 if index else 0
        lines.append(f"| {name} | {at:.0f} | {gap:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("paid", "self"), default="self")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-timeline-"))
    src = traced_copy(root)
    try:
        with one_stack(root, "timeline", src, args.path) as (_stack, target, script):
            result = run_wrk(target, script, 1, args.seconds)
        print(f"# relay timeline — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()} — {tree_state()}")
        print(f"# {args.path}, c=1, {args.seconds:g} s: {result.requests} requests, p50 {result.p50_ms:.2f} ms "
              f"(with the trace points)\n")
        print(timeline(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
