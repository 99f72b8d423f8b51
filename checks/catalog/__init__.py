"""The bug catalog as code: mutants of the spec, invariance mutants, correct variants."""
