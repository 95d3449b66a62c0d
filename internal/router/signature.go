package router

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
)

// Standard Webhooks header names. Kafka records and gRPC metadata carry the
// same names.
const (
	HeaderWebhookID        = "webhook-id"
	HeaderWebhookTimestamp = "webhook-timestamp"
	HeaderWebhookSignature = "webhook-signature"
)

// errSecretFormat says a secret is not "whsec_<base64>"; it never quotes the
// secret.
var errSecretFormat = errors.New(errBadSecret)

// signatures returns the webhook-signature value for one message (Standard
// Webhooks v1, symmetric): for every secret, in order, "v1," followed by the
// base64 HMAC-SHA256, keyed with the secret's decoded bytes, of
// "<id>.<timestamp>.<payload>"; the entries are joined by single spaces so
// that a receiver holding any one of the secrets can verify (rotation).
// timestamp is Unix seconds. It returns errSecretFormat when a secret is not
// "whsec_" + standard base64 of at least one byte.
func signatures(id string, timestamp int64, payload []byte, secrets []string) (string, error) {
	prefix := id + "." + strconv.FormatInt(timestamp, 10) + "."
	var b strings.Builder
	for i, s := range secrets {
		key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
		if err != nil || len(key) == 0 {
			return "", errSecretFormat
		}
		mac := hmac.New(sha256.New, key)
		mac.Write([]byte(prefix))
		mac.Write(payload)
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString("v1,")
		b.WriteString(base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	}
	return b.String(), nil
}
