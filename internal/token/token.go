// Package token issues and verifies Capstan's signed tokens: the
// attempt-scoped callback token handed to adapters in ExecuteRequest, and
// the resume token of an interaction sent out over the webhook and kafka
// transports (SYSTEM §6: "HMAC, constant-time, bound to application,
// execution, interaction and deadline").
//
// Wire form: "cap1." + base64url(payload) + "." + base64url(HMAC-SHA256(key,
// "cap1." + base64url(payload))). The payload is binary: a kind byte, the
// 16-byte application, execution and subject ids (the attempt's lease token
// for callbacks, the interaction id for resume tokens), the attempt number
// (4 bytes, big-endian) and the expiry (8 bytes, Unix seconds).
package token

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Kind says what a token authorises.
type Kind byte

const (
	// KindCallback authorises AdapterCallbackService calls for one attempt.
	KindCallback Kind = 1
	// KindResume authorises the completion of one interaction.
	KindResume Kind = 2
)

const (
	prefix     = "cap1."
	payloadLen = 1 + 16*3 + 4 + 8
	// MinKeyBytes is the shortest signing key accepted.
	MinKeyBytes = 32
	// MaxLen bounds the text form, so parsers can refuse long input early.
	MaxLen = 256
)

// Errors returned by Verify. ErrMalformed and ErrSignature mean the token
// was not issued by Capstan (UNAUTHENTICATED); ErrExpired means it was, but
// it is past its expiry.
var (
	ErrMalformed = errors.New("token: malformed")
	ErrSignature = errors.New("token: bad signature")
	ErrExpired   = errors.New("token: expired")
	ErrKind      = errors.New("token: wrong kind")
	ErrKey       = errors.New("token: signing key shorter than 32 bytes")
)

// Claims are what a token binds.
type Claims struct {
	Kind          Kind
	ApplicationID uuid.UUID
	ExecutionID   uuid.UUID
	// Subject is the attempt's lease token (KindCallback) or the
	// interaction id (KindResume).
	Subject   uuid.UUID
	Attempt   int
	ExpiresAt time.Time // second precision
}

// Signer issues and verifies tokens with one key. It is safe for concurrent
// use.
type Signer struct {
	key []byte
}

// NewSigner returns a signer; key must be at least MinKeyBytes long.
func NewSigner(key []byte) (*Signer, error) {
	if len(key) < MinKeyBytes {
		return nil, ErrKey
	}
	return &Signer{key: append([]byte(nil), key...)}, nil
}

// Issue returns the text form of c.
func (s *Signer) Issue(c Claims) string {
	p := make([]byte, payloadLen)
	p[0] = byte(c.Kind)
	copy(p[1:17], c.ApplicationID[:])
	copy(p[17:33], c.ExecutionID[:])
	copy(p[33:49], c.Subject[:])
	binary.BigEndian.PutUint32(p[49:53], uint32(c.Attempt))
	binary.BigEndian.PutUint64(p[53:61], uint64(c.ExpiresAt.Unix()))
	head := prefix + base64.RawURLEncoding.EncodeToString(p)
	return head + "." + base64.RawURLEncoding.EncodeToString(s.mac(head))
}

func (s *Signer) mac(head string) []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(head))
	return m.Sum(nil)
}

// Verify checks t's signature in constant time, its kind and its expiry
// against now, and returns its claims. Errors wrap ErrMalformed,
// ErrSignature, ErrKind or ErrExpired.
func (s *Signer) Verify(t string, kind Kind, now time.Time) (Claims, error) {
	if len(t) > MaxLen || !strings.HasPrefix(t, prefix) {
		return Claims{}, ErrMalformed
	}
	dot := strings.LastIndexByte(t, '.')
	if dot <= len(prefix) {
		return Claims{}, ErrMalformed
	}
	head, sigText := t[:dot], t[dot+1:]
	sig, err := b64.DecodeString(sigText)
	if err != nil {
		return Claims{}, fmt.Errorf("%w: signature encoding", ErrMalformed)
	}
	if !hmac.Equal(sig, s.mac(head)) {
		return Claims{}, ErrSignature
	}
	p, err := b64.DecodeString(head[len(prefix):])
	if err != nil || len(p) != payloadLen {
		return Claims{}, fmt.Errorf("%w: payload", ErrMalformed)
	}
	c := Claims{Kind: Kind(p[0]), Attempt: int(binary.BigEndian.Uint32(p[49:53])),
		ExpiresAt: time.Unix(int64(binary.BigEndian.Uint64(p[53:61])), 0)}
	copy(c.ApplicationID[:], p[1:17])
	copy(c.ExecutionID[:], p[17:33])
	copy(c.Subject[:], p[33:49])
	if c.Kind != kind {
		return Claims{}, ErrKind
	}
	if !now.Before(c.ExpiresAt) {
		return Claims{}, ErrExpired
	}
	return c, nil
}

// b64 decodes strictly: a non-canonical encoding (other trailing bits) of
// the same bytes is refused, so a token has exactly one text form.
var b64 = base64.RawURLEncoding.Strict()
