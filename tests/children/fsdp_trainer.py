"""Run under torchrun by tests/test_fsdp_trainer.py: labkit.lessons.fsdp_trainer's runs (its docstring says what
JOB.json holds).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/children/fsdp_trainer.py JOB.json
"""

from labkit.lessons.fsdp_trainer import main

if __name__ == "__main__":
    main()
