"""A GPU session's call checks: each call's feeds and outputs against the model, the verdict kept per call key.

``CallChecks`` checks a call as ORT's ``run`` would (native/ort_checks.py) before any copy or graph is touched,
splits its feeds into host and device ones, and names its graph signature (feed names, shapes, dtypes: the key of
a graph slot, slots.py).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from mha_ep.gpu_session.ort_calls import numpy_dtype
from mha_ep.native.ort_checks import CheckVerdicts, call_key, dtype_error, tensor_type

# call keys whose check is remembered (all forgotten at once past this); also the signatures slots.py remembers as
# eager (GraphSlots.run_eagerly reads it here, at call time)
MAX_VERDICTS = 4096


def device_feed(name: str, value, expected: str):
    """A device feed as a C-contiguous CuPy array of dtype ``expected`` (ORT's InvalidArgument otherwise)."""
    import cupy

    array = value if isinstance(value, cupy.ndarray) else cupy.from_dlpack(value)
    error = dtype_error(name, array.dtype, tensor_type(expected))
    if error is not None:
        raise error
    return array if array.flags.c_contiguous else cupy.ascontiguousarray(array)


class CallChecks:
    """A call's feeds and outputs are checked against the model once per call key (names, shapes, dtypes, where the
    feeds lie): the verdict is remembered (``wanted``, a refusal included: ort_checks.CheckVerdicts; then
    ``remember``, with the call's graph signature), so a repeated call, good or bad, pays a dictionary lookup.
    ``input_args`` are ORT's NodeArgs (a call is checked as run() checks it); ``device_array`` CuPy's ndarray."""

    def __init__(self, input_args: list, outputs: List[str], device_array):
        self.inputs = {a.name: numpy_dtype(a.type) for a in input_args}
        self._device_array = device_array
        # call key -> [wanted outputs, signature, ORT's own run takes it (small_calls.py), the slot its CuPy feeds
        # replay (CudaSessionIO._replay_known) or None]
        self._verdicts: Dict[tuple, list] = {}
        # call key -> the check's verdict (the wanted outputs, or the refusal a bad call raises again): ORT's checks,
        # before any copy or graph is touched
        self._checks = CheckVerdicts(input_args, outputs, MAX_VERDICTS)
        self.wanted = self._checks.wanted  # (key, feeds, output_names) -> the wanted outputs, or ORT's refusal

    def known(self, feeds: Mapping, output_names) -> Tuple[Optional[tuple], Optional[list]]:
        """(the call's key, its remembered verdict or None). The key is None where the call has feeds other than
        NumPy or CuPy arrays (those are checked every call): ort_checks.call_key."""
        key = call_key(feeds, output_names, self._device_array)
        return key, (self._verdicts.get(key) if key is not None else None)

    def remember(self, key: Optional[tuple], wanted: List[str], host: Mapping, device: Mapping,
                 small: bool = False) -> tuple:  # fmt: skip
        """The call's graph signature; the verdict (wanted outputs, signature, whether ORT's own run takes the
        call: OWN_RUN_MAX_BYTES in small_calls.py, and later the slot run_device's replays take) remembered under
        ``key``."""
        signature = self.signature(host, device)
        if key is not None:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = [wanted, signature, small, None]
        return signature

    def split(self, feeds: Mapping, checked: bool = False) -> tuple:
        """(host feeds, device feeds), each checked against the model's dtype (unless the call's verdict is
        known: ``checked``) and made C-contiguous."""
        import cupy

        from mha_ep.gpu_session.transfer import host_feed

        host, device = {}, {}
        if checked:  # NumPy and CuPy arrays whose names, shapes and dtypes passed before
            for name, value in feeds.items():
                if type(value) is np.ndarray:
                    host[name] = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                else:  # CuPy's own flag (``flags`` makes an object per call)
                    device[name] = value if value._c_contiguous else cupy.ascontiguousarray(value)
            return host, device
        for name, value in feeds.items():
            if isinstance(value, cupy.ndarray):  # the common device case first: no host checks
                device[name] = device_feed(name, value, self.inputs[name])
                continue
            array = host_feed(name, value, self.inputs[name])
            if array is None:
                device[name] = device_feed(name, value, self.inputs[name])
            else:
                host[name] = array
        return host, device

    @staticmethod
    def signature(host: dict, device: dict) -> tuple:
        """The call's graph signature: each feed's name, shape and dtype, by name."""
        merged = {**host, **device}
        return tuple((name, tuple(merged[name].shape), str(merged[name].dtype)) for name in sorted(merged))
