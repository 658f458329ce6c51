"""The Python-op route: MultiHeadAttention as an onnxruntime-extensions ``@onnx_op``.

  bridge.py   the onnxruntime-extensions adapter: op declaration, the array result hook
  op.py       the op body: inputs -> engine.problem -> the backend -> outputs, with its error channel
The native route (mha_ep.native) is the other way in; mha_ep.registration picks one.
"""
