"""The step loop's decisions: the sample queue and its planner, when to log and save, a step's time
parts, telling a collapsed policy from one that learns, skipping non-finite steps and stopping
on diverged weights.
"""
