"""What a micro-batch's loss is: its inputs and checks, masked importance sampling, the policy
objectives (one module each, under ``objectives/``) and the loss metrics.
"""
