"""The run's copy in Weights & Biases (`logging.wandb=true`): every metric, the composed config, the sample tables."""

from __future__ import annotations

from pathlib import Path

WANDB_MODES = ("online", "offline")
SAMPLE_COLUMNS = ["prompt", "completion", "score"]


class WandbRun:
    """One W&B run beside TensorBoard; its local files go to <run folder>/wandb."""

    def __init__(self, output_dir: Path, settings) -> None:
        """Start the run; project, name and mode come from `logging.wandb_project`, `wandb_name`, `wandb_mode`."""
        import wandb  # optional engine (0.6 s to import): validate() has checked that it is installed

        self.wandb = wandb
        self.run = wandb.init(
            project=settings.wandb_project,
            name=settings.wandb_name or output_dir.name,
            dir=str(output_dir),
            mode=settings.wandb_mode,  # None: WANDB_MODE from the environment, online by default
        )

    def config(self, config: dict) -> None:
        """The composed config (and derived sizes) as the run's W&B config."""
        self.run.config.update(config, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def samples(self, step: int, tag: str, prompts: list[str], responses: list[str], scores: list[float]) -> None:
        """A prompt / completion / score table under ``tag``."""
        rows = [[prompt, response, score] for prompt, response, score in zip(prompts, responses, scores)]
        self.run.log({tag: self.wandb.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)

    def close(self, failed: bool = False) -> None:
        """Finish the run (failed after an error); stop wandb's service process unless another run uses it."""
        self.run.finish(exit_code=1 if failed else 0)
        if self.wandb.run is None:
            self.wandb.teardown()
