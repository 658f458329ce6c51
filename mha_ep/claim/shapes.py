"""Static dtype and shape discovery for the inputs of a model's nodes, in the main graph and in subgraphs.

ORT's symbolic shape inference first (it knows com.microsoft ops and carries symbolic dims through), ONNX's own
shape inference when that fails, and the model's recorded value_info when both fail. What they leave untyped (after
a node symbolic inference cannot finish, and inside the graph attributes of com.microsoft's generation ops, where
neither inference descends) is filled by claim/type_propagation.py from the graph's own declarations and its ops.
Unknown dims are ``None``.

    infer_static_infos(model)                    the main graph's StaticInfos
    inferred_model(model)                        the model as shape inference annotated it (the first that works)
    graph_infos(graph, inferred, outer)          one graph's StaticInfos: its declarations, the inferred twin's,
                                                 the outer scope's, then type propagation
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import onnx
from packaging.version import InvalidVersion, Version

from mha_ep.claim.tensor_info import TensorInfo
from mha_ep.claim.type_propagation import StaticInfos, propagate_types
from mha_ep.dtypes import dtype_name

log = logging.getLogger("mha_ep")


def _info_from_type(type_proto: onnx.TypeProto) -> TensorInfo | None:
    if not type_proto.HasField("tensor_type"):
        return None
    tensor = type_proto.tensor_type
    shape = None
    if tensor.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return TensorInfo(dtype_name(tensor.elem_type), shape)


def collect_infos(model: onnx.ModelProto) -> Dict[str, TensorInfo]:
    """TensorInfo of every named tensor the model's main graph records (inputs, outputs, value_info,
    initializers, Constant nodes)."""
    return collect_graph_infos(model.graph)


def collect_graph_infos(graph: onnx.GraphProto) -> Dict[str, TensorInfo]:
    """TensorInfo of every named tensor ``graph`` records (not those of its subgraphs)."""
    infos: Dict[str, TensorInfo] = {}
    for value in list(graph.value_info) + list(graph.input) + list(graph.output):
        info = _info_from_type(value.type)
        if info is not None:
            infos[value.name] = info
    for init in graph.initializer:
        infos[init.name] = TensorInfo(dtype_name(init.data_type), tuple(int(d) for d in init.dims))
    for node in graph.node:  # Constant nodes carry their value
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    infos[node.output[0]] = TensorInfo(dtype_name(attr.t.data_type), tuple(attr.t.dims))
    return infos


# ORT releases whose SymbolicShapeInference internals (_preprocess, _infer_impl, _update_output_from_vi, run_,
# out_mp_) were read and tested here; outside this range only the public entry point is used.
PRIVATE_SYMBOLIC_API_TESTED = (Version("1.20"), Version("1.32"))  # [first, end)
PRIVATE_SYMBOLIC_API = ("_preprocess", "_infer_impl", "_update_output_from_vi")


def private_symbolic_api_usable(ort_version: str, inference_class) -> bool:
    """True when this ORT is in the tested range and its SymbolicShapeInference still has the internals."""
    first, end = PRIVATE_SYMBOLIC_API_TESTED
    try:
        version = Version(Version(ort_version).base_version)
    except InvalidVersion:
        return False
    return first <= version < end and all(callable(getattr(inference_class, n, None)) for n in PRIVATE_SYMBOLIC_API)


def symbolic_shape_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's symbolic shape inference, keeping a partial result.

    The public entry point ``SymbolicShapeInference.infer_shapes`` saves the model to "sym_shape_infer_temp.onnx"
    in the current directory and raises when any shape stays unknown; a partial result is still what the gate
    wants (unknown dims are accepted and re-checked at execute time), and a library must not write into the
    user's folder. So on the ORT releases we tested (``PRIVATE_SYMBOLIC_API_TESTED``) the same steps run here
    without that failure path; on any other release the public entry point runs (a model it cannot infer
    completely then falls back to ONNX shape inference, see ``infer_static_infos``).
    """
    import onnxruntime
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_opset

    opset = get_opset(model)
    if not opset or opset < 7:
        raise ValueError(f"symbolic shape inference needs ai.onnx opset >= 7, got {opset}")
    if not private_symbolic_api_usable(onnxruntime.__version__, SymbolicShapeInference):
        return _public_symbolic_shape_inference(model, SymbolicShapeInference)
    inference = SymbolicShapeInference(2**31 - 1, True, False, 0)
    inference._preprocess(model)
    while inference.run_:
        inference._infer_impl()
    inference._update_output_from_vi()
    return inference.out_mp_


def _public_symbolic_shape_inference(model: onnx.ModelProto, inference_class) -> onnx.ModelProto:
    """The public entry point, with its debugging file removed when it wrote one (it raises on a partial result)."""
    import os

    leftover = "sym_shape_infer_temp.onnx"
    existed = os.path.exists(leftover)
    try:
        inferred = inference_class.infer_shapes(model, 2**31 - 1, True, False, 0)
    finally:
        if not existed and os.path.exists(leftover):
            os.unlink(leftover)
    if inferred is None:
        raise ValueError("ORT's symbolic shape inference declined the model")
    return inferred


def inferred_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model annotated by the first shape inference that works (symbolic, then ONNX's), or the model itself."""
    try:
        return symbolic_shape_inference(model)
    except Exception as error:  # noqa: BLE001 - any failure means: try the next method
        log.debug("mha_ep: symbolic shape inference failed (%s); falling back to ONNX shape inference", error)
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as error:  # noqa: BLE001
        log.debug("mha_ep: ONNX shape inference failed (%s); using recorded shapes only", error)
    return model


def _merge(declared: TensorInfo, inferred: TensorInfo) -> TensorInfo:
    """Inference's info, with the declared element type or shape where inference has none."""
    shape = inferred.shape if inferred.shape is not None else declared.shape
    return TensorInfo(inferred.dtype or declared.dtype, shape)


def graph_infos(graph: onnx.GraphProto, inferred: Optional[onnx.GraphProto] = None, outer=None) -> StaticInfos:
    """What is known about every tensor ``graph`` reads: the outer scope's infos (a subgraph may read its
    enclosing graphs' names), the graph's own declarations, shape inference's annotations of its twin in the
    inferred model (``inferred``; None where inference did not reach), then type propagation."""
    infos: Dict[str, TensorInfo] = dict(outer or {})
    infos.update(collect_graph_infos(graph))
    if inferred is not None:
        for name, info in collect_graph_infos(inferred).items():
            infos[name] = _merge(infos[name], info) if name in infos else info
    return propagate_types(graph, infos, outer)


def infer_static_infos(model: onnx.ModelProto) -> StaticInfos:
    """Run shape inference (symbolic first) and return what it and type propagation know about every tensor of
    the main graph."""
    return graph_infos(model.graph, inferred_model(model).graph)
