"""The operator contract: slots, attributes, the plugin domain and the transport convention.

Everything that two parts of the package must agree on lives here, so that the claim gate, the partition pass,
the op registration and the tests read one description.

Layout legend used across the package (names carry their layout as a suffix):
    B batch, S query length, L new key/value length, P past length, T = P + L total key length,
    N heads, H query/key head size, Hv value head size, D = N*H, Dv = N*Hv.
    ``query_BSD`` is (B, S, D); ``key_BNLH`` is (B, N, L, H); ``scores_BNST`` is (B, N, S, T).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ORT_DOMAIN = "com.microsoft"
PLUGIN_DOMAIN = "mha_ep"
OP_TYPE = "MultiHeadAttention"
PLUGIN_OPSET = 1
# mha_ep::DecodeMatMul, the plugin domain's second op (native route only): y (..., N) = x (..., K) . weight_nk^T,
# weight_nk (N, K) the MatMul's weight transposed, float32 sums rounded to the element type; written by mha-ep
# static-cache for a decode step's weight products (rule DECODE_MATMUL), with the attributes ATTR_NODE and ATTR_DTYPE.
MATMUL_OP_TYPE = "DecodeMatMul"
MATMUL_INPUTS = ("x", "weight_nk")
MATMUL_OUTPUTS = ("y",)
MATMUL_MAX_ROWS = 8  # rows of x the rewrite gives the op (engine/cuda/gemv.py GEMV_MAX_M: its kernel's)

# Input and output slots of com.microsoft::MultiHeadAttention (ORT 1.31.1), in slot order.
INPUTS = (
    "query",  # 0 (B,S,D) or packed QKV (B,S,N,3,H)
    "key",  # 1 (B,L,D), packed KV (B,L,N,2,H) or BNSH (B,N,L,H)
    "value",  # 2 (B,L,Dv) or BNSH (B,N,L,Hv)
    "bias",  # 3 (D + D + Dv,)
    "key_padding_mask",  # 4 (B,), (3B+2,), (B,T) or (B,S,T); int32
    "attention_bias",  # 5 (B|1, N|1, S, T)
    "past_key",  # 6 (B,N,P,H)
    "past_value",  # 7 (B,N,P,Hv)
    "past_sequence_length",  # 8 one int32 (buffer sharing)
    "cache_indirection",  # 9 (B, beams, M) int32
)
OUTPUTS = ("output", "present_key", "present_value", "qk")
SLOT = {name: i for i, name in enumerate(INPUTS)}
OUT_SLOT = {name: i for i, name in enumerate(OUTPUTS)}

# Inputs and outputs of the plugin op. The onnxruntime-extensions bridge requires every declared slot, so a
# claimed node always carries these ten inputs and four outputs (see the placeholder convention below).
PLUGIN_INPUTS = INPUTS
PLUGIN_OUTPUTS = OUTPUTS
# The plugin op's qk output (output 3, (B, N, S, T)) comes in the type the node computes in: float32 on the
# Python-op route, the node's own type on the native route. ORT's QK type constraint is independent of T, so the
# partition pass adds a Cast to the declared QK type where the two differ (graph/partition.py, rule TRANSPORT).
# mha_ep before the qk output wrote claimed nodes with the first three outputs; the pass gives such a node the
# fourth, unused (graph/partition.py, rule ALREADY_CLAIMED).
LEGACY_PLUGIN_OUTPUTS = OUTPUTS[:3]
FLOAT_INPUTS = ("query", "key", "value", "bias", "attention_bias", "past_key", "past_value")
INT32_INPUTS = ("past_sequence_length", "cache_indirection")  # ORT's type constraint M: int32 only
# mha_ep before the shared buffer wrote claimed nodes with the first eight inputs only; the partition pass gives
# such a node the two new placeholder slots (graph/partition.py, rule ALREADY_CLAIMED).
LEGACY_PLUGIN_INPUTS = INPUTS[:8]


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    kind: str  # "int" | "float" | "string"
    default: object  # None: required


# ORT's attributes, with the defaults ORT's kernels use when the attribute is absent.
ORT_ATTRIBUTES = (
    AttributeSpec("num_heads", "int", None),
    AttributeSpec("mask_filter_value", "float", -10000.0),
    AttributeSpec("scale", "float", 0.0),  # 0.0 means 1/sqrt(head_size)
    AttributeSpec("unidirectional", "int", 0),
)

# Attributes the partition pass adds to a claimed node (the bridge needs every declared attribute on every node,
# so ORT's defaults are also written out explicitly).
ATTR_INPUTS = "mha_ep_inputs"  # comma-separated names of the supplied input slots
ATTR_OUTPUTS = "mha_ep_outputs"  # comma-separated names of the outputs the graph uses
ATTR_DTYPE = "mha_ep_dtype"  # element type of the original node: float32 | float16 | bfloat16
ATTR_NODE = "mha_ep_node"  # the node's name, so that an error raised inside the op can name its node
# The bridge hands float attributes to Python with 6 significant digits (measured: scale 0.15811388 arrives as
# 0.158114), so the exact values of ORT's float attributes also travel as text: "name=<float.hex()>;..."
ATTR_FLOATS = "mha_ep_floats"
PLUGIN_ATTRIBUTES = ORT_ATTRIBUTES + (
    AttributeSpec(ATTR_INPUTS, "string", None),
    AttributeSpec(ATTR_OUTPUTS, "string", None),
    AttributeSpec(ATTR_DTYPE, "string", None),
    AttributeSpec(ATTR_NODE, "string", None),
    AttributeSpec(ATTR_FLOATS, "string", None),
)

# Placeholder convention. Absent optional inputs are fed from these zero-size initializers; which slots are
# really supplied is said by ATTR_INPUTS, never guessed from sizes (a past of length 0 is a real input).
ABSENT_FLOAT = "mha_ep.absent.float32"
ABSENT_INT32 = "mha_ep.absent.int32"


def absent_float(dtype: str) -> str:
    """The placeholder of an absent float input of a node whose float tensors are ``dtype`` (float32 on the
    Python-op route; the node's own type on the native route)."""
    return f"mha_ep.absent.{dtype}"



# Unwanted outputs get a name of this form; the op returns a zero-size array for them.
UNUSED_OUTPUT_SUFFIX = "/mha_ep.unused"
# float16/bfloat16 nodes: the bridge refuses those element types, so values travel as float32 through Cast
# nodes (exact both ways: every f16/bf16 value is a float32 value, and the op rounds nothing that the Cast back
# would not). Cast inputs are named "<tensor>" + TRANSPORT_IN, the op's float32 outputs "<tensor>" + TRANSPORT_OUT
# (distinct, so that one claimed node may read another's output through its own Cast).
TRANSPORT_IN = "/mha_ep.in.f32"
TRANSPORT_OUT = "/mha_ep.out.f32"
# A model-local function with the plugin op's name. When the plugin is registered ORT runs the plugin kernel;
# when it is not, ORT falls back to this function, whose single node names the fix in ORT's own error message.
UNREGISTERED_DOMAIN = "mha_ep.not_registered"
UNREGISTERED_OP = "call_mha_ep_register_on_the_SessionOptions_first"

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
MASK_DTYPES = ("int32", "int64")


def encode_floats(values: dict) -> str:
    """{"scale": 0.158...} -> "scale=0x1.43d136p-3" (exact, float32 values included)."""
    return ";".join(f"{name}={float(value).hex()}" for name, value in sorted(values.items()))


def decode_floats(text: str) -> dict:
    """The inverse of encode_floats. Raises ValueError naming the entry for one that is not the hex form of a
    float32 value (the attributes it mirrors are float32: a crafted value beyond float32's range, or one that does
    not fit a float at all, is refused rather than rounded)."""
    import struct

    values = {}
    for item in filter(None, text.split(";")):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"entry {item[:40]!r} is not name=value")
        try:
            number = float.fromhex(value)
        except OverflowError:
            raise ValueError(f"{name}={value[:40]} is beyond float32's range") from None
        except ValueError:
            raise ValueError(f"{name}={value[:40]} is not a hexadecimal float") from None
        if number == number:  # NaN is a float32 value; compare the rest through float32
            try:
                same = struct.unpack("<f", struct.pack("<f", number))[0] == number
            except OverflowError:
                same = False
            if not same:
                raise ValueError(f"{name}={value[:40]} is not a float32 value (beyond its range or precision)")
        values[name] = number
    return values


@functools.lru_cache(maxsize=1024)
def node_config(attribute_items: tuple) -> tuple:
    """A claimed node's attributes -> (supplied input names, requested outputs, ORT attributes, dtype).

    Read by the op on every call (the same node sends the same attributes, so the parse is memoised on them) and
    by the device plan; string attributes as text.
    """
    attributes = dict(attribute_items)
    supplied = frozenset(filter(None, str(attributes[ATTR_INPUTS]).split(",")))
    wanted = set(filter(None, str(attributes[ATTR_OUTPUTS]).split(",")))
    outputs = tuple(name in wanted for name in OUTPUTS)
    ort_attributes = {a.name: attributes[a.name] for a in ORT_ATTRIBUTES if a.name in attributes}
    ort_attributes.update(decode_floats(str(attributes.get(ATTR_FLOATS, ""))))
    return supplied, outputs, ort_attributes, str(attributes[ATTR_DTYPE])
