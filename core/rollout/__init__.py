"""The rollout side's decisions: the prompt cursor, pacing, reconciling turns into training
sequences, advantages and scoring, waiting for samples, rollout metrics.
"""
