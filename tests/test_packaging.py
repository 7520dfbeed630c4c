"""The package metadata builds without the deprecations that stop working in setuptools after 2027-02-18."""

from __future__ import annotations

import tomllib

from helpers import REPO


def test_the_license_is_an_spdx_string_not_a_deprecated_table():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
