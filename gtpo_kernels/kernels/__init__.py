"""The loss-agnostic passes: Triton kernels and their PyTorch twins (one file per kernel family),
`dispatch` (which one runs), `ops` (the torch.library custom ops) and `autograd` (their backward rules).
Imports only `core`."""
