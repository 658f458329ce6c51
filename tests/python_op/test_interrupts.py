"""Ctrl-C: deferred out of any Python that ORT's run calls, raised as KeyboardInterrupt once the run returns (or the
next one, on a plain session), never an abort, never an error or NaN; bursts, floods at fresh processes, one SIGINT
in back-to-back runs, on both routes. Each case runs in a subprocess (an abort would take pytest down).

No test waits on the clock: the parent acts on what the child prints (a reader thread hands it each line as it
comes), and a child stops only when the parent says so on its stdin, after the last signal; sleeps only pace the
signals. A loaded machine makes a run slower, never a test red (issue 33)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness import NODE_PRELUDE, REPO, assert_survived, describe, run_script
from mha_ep.engine import interrupt

PATIENCE = 300  # seconds a child may take to say its next line (a loaded CI machine): then the test fails, saying so


class Child:
    """A Python child running ``script`` with ``args``: its stdout lines arrive through a reader thread, so the
    parent can wait for one (``wait_for``) or look without waiting (``said``); ``finish`` says STOP on its stdin and
    collects the rest."""

    def __init__(self, script, *args: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "support"), str(REPO / "tests"),
                                             env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen([sys.executable, str(script), *args], cwd=str(REPO), env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)  # fmt: skip
        self.lines: list = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)  # end of output

    def _take(self, timeout) -> bool:
        """One more line into ``lines`` (False at the end of the output)."""
        line = self._queue.get(timeout=timeout)
        if line is None:
            self._queue.put(None)
            return False
        self.lines.append(line)
        return True

    def wait_for(self, prefix: str) -> str:
        """The first line starting with ``prefix``; fails with the child's output when it ends first or has not
        said it within PATIENCE seconds."""
        seen, deadline = 0, time.monotonic() + PATIENCE
        while True:
            for line in self.lines[seen:]:
                if line.startswith(prefix):
                    return line
            seen = len(self.lines)
            try:
                more = self._take(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                more = None
            if not more:
                self.process.kill()
                result = self.finish()
                why = "ended" if more is False else f"had not said it after {PATIENCE} s"
                raise AssertionError(f"the child {why} before saying {prefix!r}\n{describe(result)}")

    def _drain(self) -> None:
        """Every line already read into ``lines`` (no waiting)."""
        try:
            while self._take(0):
                pass
        except queue.Empty:
            pass

    def said(self, prefix: str) -> bool:
        """Whether the child has said a line starting with ``prefix`` (no waiting)."""
        self._drain()
        return any(line.startswith(prefix) for line in self.lines)

    def finish(self) -> subprocess.CompletedProcess:
        """STOP on the child's stdin (it stops once it reads it: no signal comes after), then its exit."""
        try:
            self.process.stdin.write("STOP\n")
            self.process.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass  # it has already ended
        try:
            self.process.wait(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(PATIENCE)
        self._drain()
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, "".join(self.lines),
                                           self.process.stderr.read())  # fmt: skip


# A child's last act: wait for the parent's STOP (after its last signal), counting the interrupts that still come.
AWAIT_STOP = """
    def await_stop():
        interrupts = 0
        while True:
            try:
                sys.stdin.readline()  # STOP, or the end of stdin: the parent sends no signal after it
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                return interrupts
            except KeyboardInterrupt:
                interrupts += 1
"""


def child_script(tmp_path, name: str, body: str):
    script = tmp_path / name
    script.write_text(textwrap.dedent(NODE_PRELUDE + "    import signal\n" + AWAIT_STOP + body))
    return script

# ------------------------------------------------------------------------------------------------ 2. Ctrl-C
SIGINT_CHILD = """
    import time
    from mha_models import MhaConfig, build_model, random_feeds
    config = MhaConfig(batch=2, q_seq=64, kv_seq=64, num_heads=4, head_size=16, mask="2d", shapes="symbolic")
    feeds = random_feeds(config, np.random.default_rng(0))
    model = build_model(config)
    if sys.argv[1] == "plain":
        session = plain_session(mha_ep.partition(model).model)
    else:
        session = mha_ep.InferenceSession(model, backend="reference")
    counts = {"runs": 0, "interrupts": 0, "nan": 0, "run_errors": 0}

    def loop():
        while not stop.is_set():
            try:
                out = session.run(None, feeds)[0]
                counts["runs"] += 1
                counts["nan"] += int(np.isnan(out).any())
                if counts["runs"] == 1:
                    print("LOOPING", flush=True)  # the parent's signals start here
            except KeyboardInterrupt:
                counts["interrupts"] += 1
            except mha_ep.MhaRunError as error:
                counts["run_errors"] += 1
                print("RUN_ERROR", error, flush=True)

    import threading
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()  # the parent's STOP
    session.run(None, feeds)
    print("READY", flush=True)
    while not stop.is_set():
        try:
            loop()
        except KeyboardInterrupt:  # one that landed in this loop's own lines
            counts["interrupts"] += 1
    while True:  # STOP came after the last signal: one still pending (or re-sent) lands here, then none can
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            break
        except KeyboardInterrupt:
            counts["interrupts"] += 1
    print("COUNTS", counts, flush=True)
    print("DONE", flush=True)
"""


@pytest.mark.parametrize("kind", ["mha_ep_session", "plain"])
def test_a_burst_of_sigints_never_aborts(kind, tmp_path):
    child = Child(child_script(tmp_path, "child.py", SIGINT_CHILD), kind)
    child.wait_for("LOOPING")  # a run of its loop is done: the signals land among runs
    sent = 0
    for _ in range(150):  # issue 16 saw aborts after 7-12 signals
        if child.process.poll() is not None:
            break
        child.process.send_signal(signal.SIGINT)
        sent += 1
        time.sleep(0.015)  # pacing only: the child runs until STOP, however slow the machine
    result = child.finish()
    assert_survived(result, "COUNTS")
    counts = eval(result.stdout.split("COUNTS ")[1].splitlines()[0])  # noqa: S307 - our own child's dict
    assert sent == 150, describe(result)
    assert counts["interrupts"] > 0 and counts["runs"] > 0, describe(result)
    assert counts["run_errors"] == 0 and counts["nan"] == 0, describe(result)


FLOOD_CHILD = """
    import time
    from mha_models import MhaConfig, build_model, random_feeds
    config = MhaConfig(batch=2, q_seq=64, kv_seq=64, num_heads=4, head_size=16, mask="2d", shapes="symbolic")
    feeds = random_feeds(config, np.random.default_rng(0))
    kind, route = sys.argv[1], sys.argv[2]
    if kind == "session":
        session = mha_ep.InferenceSession(build_model(config), backend="reference", route=route)
    else:
        form = "native" if route == "native" else "python-op"
        options = mha_ep.register(ort.SessionOptions(), backend="reference", route=route)
        session = ort.InferenceSession(mha_ep.partition(build_model(config), route=form).model.SerializeToString(),
                                       options, providers=["CPUExecutionProvider"])
    counts = [0, 0]
    started = []

    def loop():
        if not started:  # (inside the loop's try: the flood starts as soon as the line is read)
            started.append(True)
            print("READY", flush=True)  # the first run is the loop's: nothing of the op's first use happened yet
        while counts[0] < RUNS:
            try:
                session.run(None, feeds)
                counts[0] += 1
            except KeyboardInterrupt:
                counts[1] += 1

    RUNS = 100
    while True:
        try:
            loop()
            break
        except KeyboardInterrupt:  # one that landed in this script's own lines
            counts[1] += 1
    while True:
        try:
            print("LOOP_DONE", flush=True)  # the parent stops its flood, then says STOP
            break
        except KeyboardInterrupt:
            counts[1] += 1
    counts[1] += await_stop()
    print("COUNTS", counts[0], counts[1], flush=True)
    print("DONE", flush=True)
"""


def flood(script, kind: str, route: str) -> subprocess.CompletedProcess:
    """Up to 200 SIGINTs, one every 4 ms from the child's first run on, until its loop is done; then STOP."""
    child = Child(script, kind, route)
    child.wait_for("READY")
    for _ in range(200):
        if child.process.poll() is not None or child.said("LOOP_DONE"):
            break
        child.process.send_signal(signal.SIGINT)
        time.sleep(0.004)  # pacing only
    return child.finish()


@pytest.mark.parametrize("kind, route", [("session", "python-op"), ("plain", "native")])
def test_a_sigint_flood_from_the_first_run_of_fresh_processes_never_aborts(kind, route, tmp_path):
    """Eight fresh processes per route (before the handler covered Python that ORT's run calls, one in five
    aborted, and nine in ten under this flood)."""
    from concurrent.futures import ThreadPoolExecutor

    script = child_script(tmp_path, "flood.py", FLOOD_CHILD)
    with ThreadPoolExecutor(4) as pool:  # four processes at a time (their start-up is most of their time)
        results = list(pool.map(lambda _: flood(script, kind, route), range(8)))
    survived = 0
    for result in results:
        assert "terminate called" not in result.stderr and "Fatal Python error" not in result.stderr, describe(result)
        if interrupted_in_its_own_lines(result, script):
            continue
        assert_survived(result, "COUNTS")
        survived += 1
    assert survived, "every child was interrupted in its own lines: the flood never reached the end of a loop"


def interrupted_in_its_own_lines(result: subprocess.CompletedProcess, script) -> bool:
    """The child ended in a KeyboardInterrupt raised in the test script's own lines (a loop head between two runs,
    where Python checks for signals, through mha_ep's handler passing it on to Python's): what Python does with a
    Ctrl-C outside any run, not an abort, and nothing of ORT or of a claimed node on the stack."""
    frames = re.findall(r'File "([^"]+)", line \d+', result.stderr.split("Exception ignored")[0])
    allowed = {str(script), str(Path(interrupt.__file__).resolve())}  # mha_ep's handler, wherever the module lives
    return (result.returncode in (-signal.SIGINT, 128 + signal.SIGINT) and bool(frames) and frames[0] == str(script)
            and set(frames) <= allowed and "KeyboardInterrupt" in result.stderr)  # fmt: skip


ONE_SIGINT_CHILD = """
    import time
    from mha_models import MhaConfig, build_model, random_feeds
    config = MhaConfig(batch=4, q_seq=512, kv_seq=512, num_heads=8, head_size=32, mask="2d", shapes="symbolic")
    feeds = random_feeds(config, np.random.default_rng(0))
    route = sys.argv[1]
    form = "native" if route == "native" else "python-op"
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route=route)
    session = ort.InferenceSession(mha_ep.partition(build_model(config), route=form).model.SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    print("READY", flush=True)
    RUNS = 200  # the bug this guards against let the loop run to its end
    ends = []
    try:
        for _ in range(RUNS):  # the parent's one SIGINT comes after our first RUN line
            session.run(None, feeds)
            ends.append(time.monotonic())
            print("RUN", flush=True)
        print("NO_INTERRUPT", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    print("ENDS", ends, flush=True)
    await_stop()
    print("DONE", flush=True)
"""


@pytest.mark.parametrize("route", ["python-op", "native"])
def test_one_sigint_during_back_to_back_plain_runs_is_raised_within_one_run(route, tmp_path):
    """A plain session has no channel to stop a run: the claimed node finishes, the interrupt stays pending and is
    re-sent as the node hands the thread back to ORT, so the run it arrived in raises KeyboardInterrupt, or (when
    ORT returns to Python before the re-sending thread gets the GIL) the next one. Before, the re-sent interrupt kept
    landing in the next run's claimed node and the loop ran to its end.

    What is asserted is the delivery, not its latency (mha_ep/engine/interrupt.py: "Not guaranteed: the latency"):
    on an idle machine no run or one completes after the signal, but on a starved one the thread that re-sends it
    may get the CPU only after the next run has entered its claimed node, where it is deferred once more (seen
    under two busy processes: 2-4 runs)."""
    child = Child(child_script(tmp_path, "one.py", ONE_SIGINT_CHILD), route)
    child.wait_for("RUN")  # a whole run is done: the signal lands inside a claimed node or between two runs
    child.process.send_signal(signal.SIGINT)
    sent = time.monotonic()  # CLOCK_MONOTONIC, the child's clock too; taken after the signal went
    child.wait_for("ENDS")
    result = child.finish()
    assert_survived(result, "INTERRUPTED")  # not NO_INTERRUPT: the loop stopped before its 200 runs
    ends = eval(result.stdout.split("ENDS ")[1].splitlines()[0])  # noqa: S307 - our own child's list
    assert ends and ends[0] < sent, f"the signal came before any timed run\n{describe(result)}"


def test_a_keyboard_interrupt_inside_the_op_is_never_an_error_nor_silent_nan():
    """The backend itself raises KeyboardInterrupt (as a Ctrl-C would, without mha_ep's SIGINT handler)."""
    result = run_script(
        NODE_PRELUDE
        + """
    import time
    from mha_models import MhaConfig, build_model, random_feeds

    class InterruptedBackend:
        name, device = "interrupted", "nowhere"

        def run(self, problem, borrow_outputs=False):
            raise KeyboardInterrupt

    config = MhaConfig(batch=1, q_seq=2, kv_seq=2, num_heads=2, head_size=4)
    feeds = random_feeds(config, np.random.default_rng(0))
    session = mha_ep.InferenceSession(build_model(config), backend="reference")
    session.backend = InterruptedBackend()
    try:
        session.run(None, feeds)
        print("NO_INTERRUPT")
    except KeyboardInterrupt:
        print("SESSION_INTERRUPT")
    except mha_ep.MhaRunError as error:
        print("RUN_ERROR", error)

    from mha_ep.engine import context
    plain = plain_session(mha_ep.partition(build_model(config)).model)
    context.set_default_backend(InterruptedBackend())
    try:
        out = plain.run(None, feeds)[0]
        for _ in range(3000):  # the interrupt is delivered again once the run has returned (300 s at most)
            time.sleep(0.1)
        print("PLAIN_NO_INTERRUPT")
    except KeyboardInterrupt:
        print("PLAIN_INTERRUPT")
    print("DONE")
    """
    )
    assert_survived(result, "SESSION_INTERRUPT", "PLAIN_INTERRUPT", "was interrupted (Ctrl-C)")
