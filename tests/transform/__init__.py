"""Tests of tfpar.transform: graph rewrites and the collectives they insert."""
