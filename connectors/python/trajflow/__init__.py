"""trajflow: the Python end of the trajflow data plane."""
