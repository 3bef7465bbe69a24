"""The test-wide fixture gives every test back the environment it started with (tests/conftest.py): a variable one
test sets (as a vLLM engine built in the test process does) is gone for the next. The two tests run in file order."""

import os

NAME = "SPARROW_TEST_LEAKED_VARIABLE"


def test_a_test_that_writes_the_environment():
    assert NAME not in os.environ
    os.environ[NAME] = "1"
    os.environ.pop("OMP_NUM_THREADS")


def test_the_next_test_does_not_see_it():
    assert NAME not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "1"
