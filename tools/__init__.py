"""Development tools shared by the scripts and the tests (not part of the shipped package):
the launch/byte account of a kernel call and the peak-memory tracker."""
