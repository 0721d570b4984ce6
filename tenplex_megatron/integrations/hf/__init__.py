"""Hugging Face transformers checkpoints in and out: ``export.py`` writes one, ``load.py`` starts a job from one."""
