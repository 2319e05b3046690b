"""torch.distributed protocols: vocabulary-parallel statistics (`vocab_parallel`), groups split across
data-parallel ranks (`data_parallel`) and the collective agreement on errors (`agree`). Imports
`core`, `kernels` and `objective`."""
