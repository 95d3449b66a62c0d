package devstack

import (
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
)

// Port range FreePorts draws from: below Linux's default ephemeral range
// (32768-60999), so that the outbound connections of other processes,
// which take ephemeral ports, cannot grab a port between the moment it is
// found free and the moment a daemon binds it.
const (
	portLow  = 20000
	portHigh = 32000
)

// FreePorts returns n distinct loopback ports that were free when checked,
// drawn at random from [20000, 32000). A process that binds one later may
// still race another program choosing the same port, which is rare; the
// ephemeral ports the kernel hands out are never among them.
func FreePorts(n int) ([]int, error) {
	out := make([]int, 0, n)
	seen := map[int]bool{}
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000*n {
			return nil, fmt.Errorf("no free loopback port found in [%d, %d)", portLow, portHigh)
		}
		p := portLow + rand.IntN(portHigh-portLow)
		if seen[p] {
			continue
		}
		seen[p] = true
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		l.Close()
		out = append(out, p)
	}
	return out, nil
}
