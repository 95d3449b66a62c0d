package router

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
)

// ErrForbiddenAddress is wrapped by every [AddressError]: a webhook
// connection was refused because its resolved address is not public and
// config.Router.AllowPrivateAddresses is false.
var ErrForbiddenAddress = errors.New("webhook address not allowed")

// AddressError says which resolved address a webhook connection was refused
// for and why ("loopback", "private", "link-local", …).
type AddressError struct {
	Addr   netip.Addr
	Reason string
}

// Error returns, for example, "webhook address not allowed: 127.0.0.1 is loopback".
func (e *AddressError) Error() string {
	return fmt.Sprintf("%v: %s is %s", ErrForbiddenAddress, e.Addr, e.Reason)
}

// Unwrap returns ErrForbiddenAddress.
func (e *AddressError) Unwrap() error { return ErrForbiddenAddress }

// reservedPrefixes are the non-public ranges that netip's predicates do not
// already cover, with the reason a refusal names.
var reservedPrefixes = []struct {
	prefix netip.Prefix
	reason string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), "in this-network 0.0.0.0/8"},
	{netip.MustParsePrefix("100.64.0.0/10"), "shared address space (carrier-grade NAT)"},
	{netip.MustParsePrefix("192.0.0.0/24"), "IETF protocol assignment"},
	{netip.MustParsePrefix("198.18.0.0/15"), "benchmarking"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved or broadcast"},
	{netip.MustParsePrefix("fec0::/10"), "site-local"},
}

// nat64 is the well-known NAT64 prefix; its addresses embed an IPv4 address
// that is checked in turn.
var nat64 = netip.MustParsePrefix("64:ff9b::/96")

// checkAddress returns an *AddressError when a is not a public unicast
// address, nil otherwise. IPv4-mapped and NAT64 IPv6 addresses are judged
// by the IPv4 address they carry.
func checkAddress(a netip.Addr) error {
	a = a.Unmap()
	if a.Is6() && nat64.Contains(a) {
		b := a.As16()
		if err := checkAddress(netip.AddrFrom4([4]byte(b[12:]))); err != nil {
			return &AddressError{Addr: a, Reason: "NAT64 of a non-public address"}
		}
	}
	reason := ""
	switch {
	case !a.IsValid():
		reason = "invalid"
	case a.IsUnspecified():
		reason = "unspecified"
	case a.IsLoopback():
		reason = "loopback"
	case a.IsPrivate():
		reason = "private"
	case a.IsLinkLocalUnicast():
		reason = "link-local"
	case a.IsMulticast(), a.IsLinkLocalMulticast(), a.IsInterfaceLocalMulticast():
		reason = "multicast"
	default:
		for _, r := range reservedPrefixes {
			if r.prefix.Contains(a) {
				reason = r.reason
				break
			}
		}
	}
	if reason == "" {
		return nil
	}
	return &AddressError{Addr: a, Reason: reason}
}

// refuseNonPublic is a net.Dialer Control hook. It runs after name
// resolution, once for every address the dialer tries, so the check applies
// to the address actually connected to (DNS rebinding cannot slip past it).
func refuseNonPublic(_, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return fmt.Errorf("%w: dial address %q: %w", ErrForbiddenAddress, address, err)
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return fmt.Errorf("%w: dial address %q: %w", ErrForbiddenAddress, address, err)
	}
	return checkAddress(a.WithZone(""))
}
