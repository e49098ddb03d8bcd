"""Template filters of the operator's dashboard (`{% load gp_dashboard %}`)."""
