"""The rule of a CUDA-graph session: ORT captures the graph over the addresses bound at its first runs and replays it
over those addresses forever after. A buffer bound afresh later is never read: the replay reads the old one (freed,
perhaps reused) and returns wrong values with no error. ``CapturedBinding`` is an IOBinding that holds to the rule:
once the session has run, binding a name to another address, shape or element type is refused with an error that
says what to do instead (copy into the bound buffer, or open a new session for new buffers).

    binding = CapturedBinding(session, device_id)
    binding.bind_input("encoder_hidden_states", states)      # a CuPy array; any name, any number of times
    binding.run(run_options)                                 # the first run: the addresses are now the graph's
    binding.bind_input("encoder_hidden_states", states)      # the same buffer again: fine
    binding.bind_input("encoder_hidden_states", new_states)  # another buffer: CapturedBindingError
    binding.verify({"encoder_hidden_states": states})        # arrays held elsewhere still the bound ones?

mha_ep/decode/static_decode.py's StaticDecoder binds through it and verifies its own buffers before every loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from mha_ep.errors import MhaInputError


class CapturedBindingError(MhaInputError):
    """A buffer bound to a CUDA-graph session after its graph was captured (the replay would not read it)."""


@dataclass(frozen=True)
class Bound:
    """What one name is bound to: the device address, the shape and the element type (NumPy's name)."""

    address: int
    shape: tuple
    dtype: str

    def text(self) -> str:
        return f"0x{self.address:x} {self.dtype}{list(self.shape)}"


def bound_of(array) -> Bound:
    """A CuPy array's address, shape and element type."""
    return Bound(int(array.data.ptr), tuple(int(d) for d in array.shape), str(array.dtype))


def rebind_problem(kind: str, name: str, was: Bound, now: Bound) -> str:
    """The sentence for a ``kind`` ("input" / "output") ``name`` bound as ``was`` when the graph was captured and
    asked to be ``now``; "" when they are the same."""
    if was == now:
        return ""
    return (f"{kind} {name!r} was bound at {was.text()} when ORT captured the decoder's CUDA graph; binding it "
            f"at {now.text()} would not be seen: every replay reads the buffer it was captured with. Copy the new "
            f"values into the bound buffer instead (StaticDecoder.set_inputs, or array[...] = values), or open a "
            f"new session (a new StaticDecoder) for new buffers")  # fmt: skip


class CapturedBinding:
    """An ORT IOBinding of ``session`` (CuPy arrays on ``device_id``) that refuses a new address, shape or element
    type for a name once the session has run (module docstring)."""

    def __init__(self, session, device_id: int = 0):
        self.session, self.device_id = session, device_id
        self.binding = session.io_binding()
        self.inputs: Dict[str, Bound] = {}
        self.outputs: Dict[str, Bound] = {}
        self.captured = False  # True once run() was called: ORT may have captured the graph

    def _check(self, kind: str, table: Dict[str, Bound], name: str, array) -> bool:
        """Whether ``array`` needs binding (False: bound to it already); CapturedBindingError after capture."""
        now = bound_of(array)
        was = table.get(name)
        if was == now:
            return False
        if self.captured and was is not None:
            raise CapturedBindingError(rebind_problem(kind, name, was, now))
        if self.captured:
            raise CapturedBindingError(f"{kind} {name!r} was not bound when ORT captured the decoder's CUDA graph; "
                                       "bind every buffer before the first run")  # fmt: skip
        table[name] = now
        return True

    def bind_input(self, name: str, array) -> None:
        if self._check("input", self.inputs, name, array):
            self.binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape),
                                    array.data.ptr)  # fmt: skip

    def bind_output(self, name: str, array) -> None:
        if self._check("output", self.outputs, name, array):
            self.binding.bind_output(name, "cuda", self.device_id, array.dtype.type, list(array.shape),
                                     array.data.ptr)  # fmt: skip

    def verify(self, inputs: Mapping[str, object], outputs: Optional[Mapping[str, object]] = None) -> None:
        """CapturedBindingError when an array the caller holds for a bound name (e.g. ``decoder.fixed[name]``
        replaced by a new array) is not the buffer bound under that name."""
        for kind, table, arrays in (("input", self.inputs, inputs), ("output", self.outputs, outputs or {})):
            for name, array in arrays.items():
                if name not in table:
                    raise CapturedBindingError(f"{kind} {name!r} is not bound")
                problem = rebind_problem(kind, name, table[name], bound_of(array))
                if problem:
                    raise CapturedBindingError(problem.replace("binding it at", "the array now held for it is at"))

    def run(self, run_options=None) -> None:
        """One run (a capture, or a replay of the captured graph) with the bound buffers."""
        self.captured = True
        self.session.run_with_iobinding(self.binding, run_options)
