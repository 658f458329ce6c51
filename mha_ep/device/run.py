"""Walking a device plan: one loop for every executor.

An executor holds tensors of its own kind (CuPy arrays on the GPU in device mode; NumPy arrays in the CPU twin
that tests the cut) and knows four things: take a feed, run a piece, run an attention step, hand an output back.
``run_plan`` feeds the steps in order and drops each tensor after its last reader, so a long model holds only the
tensors still needed (in device mode that returns ORT's and CuPy's memory between steps).

``HostExecutor`` is the plan's CPU twin: pieces as ORT CPU sessions, attention steps on a backend that takes host
arrays (the reference backend). It is how CI checks that the cut computes what stock ORT computes on the whole
model; it is no faster than the bridge and not meant for use.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Protocol, Sequence

import numpy as np

from mha_ep.device.plan import AttentionStep, DevicePlan, PieceStep
from mha_ep.errors import MhaEpError, refusal_code, run_error


class Executor(Protocol):
    def feed(self, name: str, value, dtype: str): ...

    def constant(self, array: np.ndarray): ...

    def run_piece(self, piece: PieceStep, inputs: Dict[str, object]) -> Dict[str, object]: ...

    def run_attention(self, step: AttentionStep, inputs: Sequence[Optional[object]]) -> List[Optional[object]]: ...


def check_call(plan: DevicePlan, feeds: Mapping[str, object], output_names: Optional[Sequence[str]]) -> List[str]:
    """The output names a call asks for (all graph outputs when None); ValueError naming the feed or output that
    does not fit the model."""
    missing = [name for name in plan.inputs if name not in feeds]
    if missing:
        raise ValueError(f"missing feed(s) for graph input(s) {missing}; the model's inputs are {list(plan.inputs)}")
    unknown = [name for name in feeds if name not in plan.inputs]
    if unknown:
        raise ValueError(f"feed(s) {unknown} name no graph input; the model's inputs are {list(plan.inputs)}")
    wanted = list(plan.outputs) if not output_names else list(output_names)
    bad = [name for name in wanted if name not in plan.outputs]
    if bad:
        raise ValueError(f"output(s) {bad} are not graph outputs; the model's outputs are {list(plan.outputs)}")
    return wanted


def run_plan(plan: DevicePlan, executor: Executor, feeds: Mapping[str, object], constants: Mapping[str, object],
             output_names: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Run every step of ``plan`` on ``executor``; returns the graph outputs named in ``output_names`` (all when
    None) as the executor's tensors. ``constants``: the plan's constants, already made by ``executor.constant``."""
    wanted = check_call(plan, feeds, output_names)
    tensors: Dict[str, object] = dict(constants)
    for name in plan.inputs:
        tensors[name] = executor.feed(name, feeds[name], plan.dtypes[name])
    run_steps(plan, executor, tensors)
    return {name: tensors[name] for name in wanted}


def run_steps(plan: DevicePlan, executor: Executor, tensors: Dict[str, object], start: int = 0,
              stop: Optional[int] = None) -> None:  # fmt: skip
    """Run ``plan.steps[start:stop]`` on ``tensors`` (name -> executor tensor: what earlier steps, the feeds and
    the constants left), adding each step's outputs and dropping each tensor after its last reader."""
    for step, drops in zip(plan.steps[start:stop], plan.drops[start:stop]):
        if isinstance(step, PieceStep):
            tensors.update(executor.run_piece(step, {name: tensors[name] for name in step.inputs}))
        else:
            results = executor.run_attention(step, [None if t is None else tensors[t] for t in step.inputs])
            for name, value in zip(step.outputs, results):
                if name is not None:
                    tensors[name] = value
        for name in drops:
            tensors.pop(name, None)


def attention_problem(step: AttentionStep, arrays: Sequence[Optional[object]], mask_resolver=None):
    """The MhaProblem of one attention step (shared rules; raises MhaRunError naming the node)."""
    from mha_ep.ops.problem import build_problem

    try:
        return build_problem(step.attributes, list(arrays), step.dtype, step.wanted, mask_resolver)
    except MhaEpError as error:
        raise run_error(step.node_name, str(error), refusal_code(error)) from None


# ------------------------------------------------------------------------------------------------ CPU twin
class HostExecutor:
    """Pieces on ORT CPU sessions, attention steps on a host backend (float32 transport, as the bridge does)."""

    def __init__(self, plan: DevicePlan, backend, sess_options=None):
        self.plan = plan
        self.backend = backend
        self.sess_options = sess_options
        self._sessions: Dict[int, object] = {}

    def feed(self, name: str, value, dtype: str):
        array = np.asarray(value)
        if str(array.dtype) != dtype:
            raise ValueError(f"feed {name!r} has dtype {array.dtype}, the model expects {dtype}")
        return array

    def constant(self, array: np.ndarray):
        return array

    def run_piece(self, piece: PieceStep, inputs: Dict[str, object]) -> Dict[str, object]:
        import onnxruntime as ort

        session = self._sessions.get(id(piece))
        if session is None:
            session = ort.InferenceSession(piece.model.SerializeToString(), self.sess_options,
                                           providers=["CPUExecutionProvider"])  # fmt: skip
            self._sessions[id(piece)] = session
        values = session.run(list(piece.outputs), dict(inputs))
        return dict(zip(piece.outputs, values))

    def run_attention(self, step: AttentionStep, inputs: Sequence[Optional[object]]) -> List[Optional[object]]:
        arrays = [None if a is None else (a.astype(np.float32) if a.dtype == np.float16 else a) for a in inputs]
        problem = attention_problem(step, arrays)
        try:
            result = self.backend.run(problem)
        except MhaEpError as error:
            raise run_error(step.node_name, str(error), refusal_code(error)) from None
        values = (result.output_BSDv, result.present_key_BNTH, result.present_value_BNTHv)
        return [None if name is None else value.astype(step.dtype) for name, value in zip(step.outputs, values)]
