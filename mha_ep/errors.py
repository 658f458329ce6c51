"""Errors raised by mha_ep. Every message names the input, its shape and what was expected."""

MESSAGE_PREFIX = "mha_ep MultiHeadAttention: "  # every refusal and input error starts with it


class MhaEpError(RuntimeError):
    """Base class of every error mha_ep raises on purpose."""


class MhaInputError(MhaEpError, ValueError):
    """An input of a MultiHeadAttention call breaks a rule (shape, rank, dtype, consistency)."""


class BackendUnavailableError(MhaEpError):
    """The requested backend cannot run here (no CuPy, no GPU, wrong device)."""


class MhaRunError(MhaEpError):
    """A claimed node failed inside the plugin op during a run; carries the node's message."""

    def __init__(self, node_name: str, message: str):
        self.node_name = node_name
        self.message = message
        detail = message.removeprefix(MESSAGE_PREFIX)
        super().__init__(f"mha_ep MultiHeadAttention node {node_name!r}: {detail}")


class MhaModelError(MhaEpError, ValueError):
    """A model mha_ep refuses to load or write: a crafted ``mha_ep`` node, an unsafe output path."""
