package pgstore

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"

	"github.com/capstan-dev/capstan/internal/execution"
)

// Signing secret format and bounds (Standard Webhooks symmetric scheme).
const (
	// SecretPrefix starts every signing secret: "whsec_" + base64.
	SecretPrefix = "whsec_"
	// MinSecretBytes and MaxSecretBytes bound a decoded signing secret
	// (Standard Webhooks: 24 to 64 random bytes).
	MinSecretBytes = 24
	MaxSecretBytes = 64
	// GeneratedSecretBytes is the size of secrets made by GenerateSecret.
	GeneratedSecretBytes = 32
	// sealedPrefix marks a secret encrypted by a SecretBox.
	sealedPrefix = "aesgcm1:"
)

// ErrSecretKey is wrapped by every failure to decrypt a stored secret: no
// key configured (config router.secret_key) for an encrypted secret, or the
// wrong key.
var ErrSecretKey = errors.New("signing secret cannot be decrypted")

// SecretBox encrypts signing secrets at rest with AES-256-GCM. Each sealed
// secret is bound to its application (the id is the additional data), so a
// ciphertext copied to another application's row does not open. A nil
// *SecretBox is valid: it stores secrets in plaintext (the documented
// development fallback when router.secret_key is unset) and opens only
// plaintext ones. It is safe for concurrent use.
type SecretBox struct {
	aead cipher.AEAD
}

// NewSecretBox returns a box for key, the base64 of exactly 32 bytes (config
// router.secret_key). An empty key returns (nil, nil): the plaintext
// fallback. A malformed key is an error.
func NewSecretBox(key string) (*SecretBox, error) {
	if key == "" {
		return nil, nil
	}
	raw, err := base64.StdEncoding.DecodeString(key)
	if err != nil || len(raw) != 32 {
		return nil, errors.New("secret key: want base64 of exactly 32 bytes")
	}
	block, err := aes.NewCipher(raw)
	if err != nil {
		return nil, fmt.Errorf("secret key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("secret key: %w", err)
	}
	return &SecretBox{aead: aead}, nil
}

// Encrypts reports whether b seals secrets (false for the nil fallback).
func (b *SecretBox) Encrypts() bool { return b != nil }

// seal returns the stored form of secret for application app.
func (b *SecretBox) seal(app uuid.UUID, secret string) (string, error) {
	if b == nil {
		return secret, nil
	}
	nonce := make([]byte, b.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return "", fmt.Errorf("seal secret: %w", err)
	}
	out := b.aead.Seal(nonce, nonce, []byte(secret), app[:])
	return sealedPrefix + base64.StdEncoding.EncodeToString(out), nil
}

// open returns the plaintext of a stored secret of application app.
// Errors wrap ErrSecretKey and never contain the secret.
func (b *SecretBox) open(app uuid.UUID, stored string) (string, error) {
	enc, ok := strings.CutPrefix(stored, sealedPrefix)
	if !ok {
		return stored, nil // plaintext (development, or not yet sealed)
	}
	if b == nil {
		return "", fmt.Errorf("%w: it is encrypted and router.secret_key is not set", ErrSecretKey)
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(raw) < b.aead.NonceSize() {
		return "", fmt.Errorf("%w: malformed ciphertext", ErrSecretKey)
	}
	n := b.aead.NonceSize()
	pt, err := b.aead.Open(nil, raw[:n], raw[n:], app[:])
	if err != nil {
		return "", fmt.Errorf("%w: wrong router.secret_key", ErrSecretKey)
	}
	return string(pt), nil
}

// ValidateSecret checks that s is a Standard Webhooks signing secret:
// "whsec_" followed by standard base64 of MinSecretBytes..MaxSecretBytes
// bytes. The error is an *execution.InvalidArgumentError naming field and
// never quoting the secret.
func ValidateSecret(field, s string) error {
	raw, ok := strings.CutPrefix(s, SecretPrefix)
	if !ok {
		return &execution.InvalidArgumentError{Field: field, Reason: "want whsec_ followed by base64"}
	}
	key, err := base64.StdEncoding.DecodeString(raw)
	if err != nil {
		return &execution.InvalidArgumentError{Field: field, Reason: "not valid base64 after whsec_"}
	}
	if len(key) < MinSecretBytes || len(key) > MaxSecretBytes {
		return &execution.InvalidArgumentError{Field: field,
			Reason: fmt.Sprintf("decodes to %d bytes, want %d-%d", len(key), MinSecretBytes, MaxSecretBytes)}
	}
	return nil
}

// GenerateSecret returns a fresh signing secret of GeneratedSecretBytes
// random bytes, "whsec_<base64>".
func GenerateSecret() string {
	key := make([]byte, GeneratedSecretBytes)
	_, _ = rand.Read(key) // crypto/rand.Read never fails (Go ≥ 1.24)
	return SecretPrefix + base64.StdEncoding.EncodeToString(key)
}

// SecretFingerprint is the hex of the first 8 bytes of SHA-256 over secret
// as registered: it tells secrets apart without revealing them.
func SecretFingerprint(secret string) string {
	h := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(h[:8])
}
