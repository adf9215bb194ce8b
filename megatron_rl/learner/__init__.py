"""Learner: parallel init, model/optimizer build, logprob forward, train step, packing."""
