"""Development tools shared by the scripts, the tests and the noxfile (not part of the shipped
package): the launch/byte account of a kernel call, the peak-memory tracker, and the installer
of real-vLLM virtualenvs on this CPU-only machine (``vllm_env``)."""
