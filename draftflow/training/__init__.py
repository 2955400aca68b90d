"""Drafter training: the loop, its batches and objectives, checkpoints, distributed helpers, torchrun launch.

`loop.train_drafter` trains from loaded samples; `job.train_here` is one training run from the
train stage's inputs (what the stage runs in-process and each torchrun rank runs); `launch` runs
ranks under torchrun; `metrics` writes the curves and summary afterwards. No Prefect, no stage
outputs: the train stage (`draftflow.stages.train`) commits results and writes the manifest.
"""
