"""`python -m cephalo.trainer` (also under `torchrun -m cephalo.trainer`): one rank of a
Cephalo job, driven entirely by the environment described in DESIGN.md."""

from cephalo.trainer.run import main

if __name__ == "__main__":
    raise SystemExit(main())
