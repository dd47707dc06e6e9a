"""Gyre orchestrator service: rollouts, rewards, advantages, packing, weight relay, eval."""
