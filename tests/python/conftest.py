"""Shared pytest fixtures: the devices to test (cpu, and cuda when customops was built with it)."""

import pytest
import torch

import customops  # noqa: F401  (loads libcustomops.so)
from customops import testing

DEVICES = testing.devices()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
