"""Value types of the problem: the model, the hardware, the engine and the layout, and their rules.

Pure data and pure functions; nothing here prints, reads the environment or imports the estimator.
"""
