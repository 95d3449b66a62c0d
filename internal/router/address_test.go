package router

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheckAddress(t *testing.T) {
	t.Parallel()
	tests := []struct {
		addr   string
		reason string // "" means allowed
	}{
		{"93.184.216.34", ""},
		{"8.8.8.8", ""},
		{"2606:4700:4700::1111", ""},
		{"127.0.0.1", "loopback"},
		{"127.255.0.9", "loopback"},
		{"::1", "loopback"},
		{"::ffff:127.0.0.1", "loopback"},
		{"10.1.2.3", "private"},
		{"172.16.0.1", "private"},
		{"172.31.255.255", "private"},
		{"192.168.1.1", "private"},
		{"fd00::1", "private"},
		{"169.254.169.254", "link-local"},
		{"fe80::1", "link-local"},
		{"0.0.0.0", "unspecified"},
		{"::", "unspecified"},
		{"0.1.2.3", "in this-network 0.0.0.0/8"},
		{"100.64.0.1", "shared address space (carrier-grade NAT)"},
		{"192.0.0.8", "IETF protocol assignment"},
		{"198.18.0.1", "benchmarking"},
		{"255.255.255.255", "reserved or broadcast"},
		{"224.0.0.1", "multicast"},
		{"ff02::1", "multicast"},
		{"fec0::1", "site-local"},
		{"64:ff9b::7f00:1", "NAT64 of a non-public address"},
		{"64:ff9b::808:808", ""},
		{"172.32.0.1", ""},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			t.Parallel()
			err := checkAddress(netip.MustParseAddr(tt.addr))
			if tt.reason == "" {
				require.NoError(t, err)
				return
			}
			var ae *AddressError
			require.ErrorAs(t, err, &ae)
			require.Equal(t, tt.reason, ae.Reason)
			require.ErrorIs(t, err, ErrForbiddenAddress)
			require.Contains(t, err.Error(), tt.reason)
		})
	}
}

func TestRefuseNonPublic(t *testing.T) {
	t.Parallel()
	tests := []struct {
		address string
		allowed bool
	}{
		{"93.184.216.34:443", true},
		{"[2606:4700:4700::1111]:443", true},
		{"127.0.0.1:80", false},
		{"[::1]:80", false},
		{"[fe80::1%eth0]:80", false},
		{"no-port", false},
		{"not-an-ip:80", false},
	}
	for _, tt := range tests {
		t.Run(tt.address, func(t *testing.T) {
			t.Parallel()
			err := refuseNonPublic("tcp", tt.address, nil)
			if tt.allowed {
				require.NoError(t, err)
				return
			}
			require.True(t, errors.Is(err, ErrForbiddenAddress), "error %v", err)
		})
	}
}
