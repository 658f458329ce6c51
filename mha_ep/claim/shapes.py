"""Static dtype and shape discovery for the inputs of a model's nodes.

ORT's symbolic shape inference first (it knows com.microsoft ops and carries symbolic dims through), ONNX's own
shape inference when that fails, and the model's recorded value_info when both fail. Unknown dims are ``None``.
"""

from __future__ import annotations

import logging
from typing import Dict

import onnx

from mha_ep.claim.tensor_info import TensorInfo
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
    """TensorInfo of every named tensor the model records (inputs, outputs, value_info, initializers)."""
    graph = model.graph
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


def symbolic_shape_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's SymbolicShapeInference.infer_shapes without its failure path.

    The public entry point saves the model to "sym_shape_infer_temp.onnx" (plus external-data files) in the current
    directory and raises when any shape stays unknown. A partial result is still what the gate wants (unknown dims
    are accepted and re-checked at execute time), and a library must not write into the user's folder.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_opset

    opset = get_opset(model)
    if not opset or opset < 7:
        raise ValueError(f"symbolic shape inference needs ai.onnx opset >= 7, got {opset}")
    inference = SymbolicShapeInference(2**31 - 1, True, False, 0)
    inference._preprocess(model)
    while inference.run_:
        inference._infer_impl()
    inference._update_output_from_vi()
    return inference.out_mp_


def infer_static_infos(model: onnx.ModelProto) -> Dict[str, TensorInfo]:
    """Run shape inference (symbolic first) and return what it knows about every tensor."""
    inferred = None
    try:
        inferred = symbolic_shape_inference(model)
    except Exception as error:  # noqa: BLE001 - any failure means: try the next method
        log.debug("mha_ep: symbolic shape inference failed (%s); falling back to ONNX shape inference", error)
    if inferred is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception as error:  # noqa: BLE001
            log.debug("mha_ep: ONNX shape inference failed (%s); using recorded shapes only", error)
            inferred = model
    infos = collect_infos(model)
    infos.update(collect_infos(inferred))
    return infos
