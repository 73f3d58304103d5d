"""What a step costs without running it: the cost model (costmodel), runtime memory beside the tensor
peak, the hardware and its calibration, checkpoint and time-to-train arithmetic, and the published
runs (data/) the rates are fitted to and held out against."""
