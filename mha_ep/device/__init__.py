"""Device-resident mode: a whole model on the GPU, ORT CUDA pieces and our attention kernels on one stream.

    plan.py    the cut: a partitioned model -> ORT pieces + attention steps (pure ONNX; no onnxruntime, no CuPy)
    run.py     the loop over a plan's steps, shared by every executor, and the plan's CPU twin (tests)
    cuda.py    the GPU executor: ORT CUDA sessions through IOBinding on CuPy memory, the cuda backend's device
               entry, one CUDA stream, whole calls replayed as CUDA graphs

``mha_ep.InferenceSession(..., providers=["CUDAExecutionProvider", ...], device_mode="device")`` asks for this
mode (DeviceModeUnavailableError says why it cannot run); without it a GPU session is one ORT session on the
native route (mha_ep/native/cuda_io.py). Device mode stays for repeated shapes, where its whole-call graphs are
still faster than ORT's graph around the native op (docs/BENCH.md, section 5).
"""

from mha_ep.device.plan import AttentionStep, DevicePlan, DevicePlanError, PieceStep, plan_device

__all__ = ["AttentionStep", "DevicePlan", "DevicePlanError", "PieceStep", "plan_device"]
