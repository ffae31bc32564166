"""Cephalo trainer: uneven-shard FSDP with layered gradient accumulation (torch only).

Modules:

* `models`, `layers`  GPT / Llama / ViT / BERT as units (embedding, blocks, head);
  `build_model(config)` matches `cephalo.api.models.ModelConfig` exactly.
* `flat`              one flat buffer per unit, contiguous per-rank shards.
* `collectives`       uneven AllGather / ReduceScatter (gloo and NCCL), async, counted.
* `unit_ops`          the per-unit compute (checkpointed forward, recompute + backward,
  fused head, freeing and refilling a kept block's parameters), activation offload,
  `run_unit_for_profile` for the profiler.
* `engine`            the step (layered schedule, exact loss weighting, sharded AdamW step);
  `passes` its forward/backward passes: recompute, kept blocks (a rank plan's
  `kept_blocks`; those every rank keeps run per microbatch with the head, the fused tail),
  keep everything (`recompute: false`), and the evaluation forward.
* `checkpoint`, `checkpoint_write`, `storage`  sharded checkpoints on a shared folder or
  object storage (fsspec): asynchronous upload, marker written last, per-rank verification.
* `optim`, `data`, `metrics`, `env`, `run`  the rest of a training run;
  `python -m cephalo.trainer` is `run.main` (SIGTERM: checkpoint at the agreed step, exit 143).
* `spawn`, `forked`   N local gloo ranks, and `python -m MODULE` in a forked process, from one
  fork server that imported torch once, for tests and benchmarks.
* `torch_memory`      peak bytes torch allocates on the CPU (memory-model tests, benchmarks).
"""
