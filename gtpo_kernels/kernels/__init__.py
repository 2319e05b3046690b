"""The loss-agnostic passes: Triton kernels and their PyTorch twins (one file per kernel family),
`dispatch` (which one runs), `ops` (the torch.library custom ops) and `autograd` (their backward rules).
Imports only `core`."""
from . import check_triton  # noqa: F401,E402 (registers the checks' one-launch form with core.checks)
