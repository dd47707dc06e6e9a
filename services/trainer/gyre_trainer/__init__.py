"""Gyre trainer service: RL objectives, batch intake, weight publishing, checkpoints, SFT."""
