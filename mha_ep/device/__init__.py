"""Device-resident mode: a whole model on the GPU, ORT CUDA pieces and our attention kernels on one stream.

    plan.py    the cut: a partitioned model -> ORT pieces + attention steps (pure ONNX; no onnxruntime, no CuPy)
    run.py     the loop over a plan's steps, shared by every executor, and the plan's CPU twin (tests)
    cuda.py    the GPU executor: ORT CUDA sessions through IOBinding on CuPy memory, the cuda backend's device
               entry, one CUDA stream, whole calls replayed as CUDA graphs

``mha_ep.InferenceSession(..., providers=["CUDAExecutionProvider", ...])`` picks this mode when it can and says
why when it cannot (``session.mode``, ``session.mode_reason``).
"""

from mha_ep.device.plan import AttentionStep, DevicePlan, DevicePlanError, PieceStep, plan_device

__all__ = ["AttentionStep", "DevicePlan", "DevicePlanError", "PieceStep", "plan_device"]
