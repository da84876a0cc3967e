"""Pipeline parallelism over the `pipeline` mesh axis. The model never imports it: it reads the model's stacks
(model/transformer.py STACKS) and runs a stack through the model's `run_stack` hook.

  stages.py       stage layout: which stacks are split, storage order and `reorder` between layouts, the GPipe and
                  circular schedules (`run`, `stack_runner`: the model's hook), the one bubble formula (`bubble`),
                  the start-up summary, `batch_rules`
  tables.py       schedule tables: 1F1B, interleaved 1F1B and the zero-bubble tables (`table`, `for_config`,
                  `from_order`, `build`, `Table`)
  executor.py     runs a table: the whole model's forward and backward, chunk by chunk on the stages (`run`)
  zero_bubble.py  zero-bubble orders: ZB-H1, ZB-V, DualPipeV (the backward split into b and W)
  wsplit.py       the exact b/W split of a traced backward
  restgrads.py    where a stage accumulates the gradients of the weights outside the pipelined stack
"""
