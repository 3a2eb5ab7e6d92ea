package operators

import (
	"fmt"
	"strconv"
	"strings"
)

// parseDevice reads a train device name: "" or "cpu" (ordinal -1), "cuda"
// (GPU 0) or "cuda:N" (GPU N >= 0).
func parseDevice(device string) (cuda bool, ordinal int, err error) {
	switch device {
	case "", "cpu":
		return false, -1, nil
	case "cuda":
		return true, 0, nil
	}
	if n, ok := strings.CutPrefix(device, "cuda:"); ok {
		if k, err := strconv.Atoi(n); err == nil && k >= 0 {
			return true, k, nil
		}
	}
	return false, 0, fmt.Errorf("operators: train --device %q: want cpu, cuda or cuda:N (a GPU ordinal >= 0)", device)
}

// CheckDevice reports whether device names a train device parseDevice
// reads (whether this build can run it is Backend's answer).
func CheckDevice(device string) error {
	_, _, err := parseDevice(device)
	return err
}
