"""envq's test suite, laid out like the code it tests."""
