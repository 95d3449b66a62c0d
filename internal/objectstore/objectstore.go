// Package objectstore stores named, immutable-once-published objects (files) and
// publishes them atomically through write sessions.
//
// The Store interface is provider-neutral. Local implements it on a directory of
// the local file system (write to a temporary file in the target directory,
// fsync, rename). An S3-compatible provider would implement the same interface
// with a multipart upload as the write session: Create starts the upload, Write
// uploads parts, Commit completes the upload (the object becomes visible
// atomically) and Abort aborts it (no object is created). In both cases a
// session that is neither committed nor aborted never makes a partial object
// visible under its key.
package objectstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
	"unicode/utf8"
)

// ErrNotFound reports that no object is published under the requested key.
var ErrNotFound = errors.New("objectstore: object not found")

// ErrInvalidKey reports a key that is not a valid object key; see ValidateKey.
var ErrInvalidKey = errors.New("objectstore: invalid key")

// ErrClosed reports use of a Writer after Commit or Abort.
var ErrClosed = errors.New("objectstore: write session closed")

// Store reads and publishes objects addressed by keys.
//
// Keys are slash-separated relative paths (see ValidateKey). Implementations
// must be safe for concurrent use by multiple goroutines.
type Store interface {
	// Open returns a reader of the object published under key. The caller
	// must close it. Errors: ErrInvalidKey, ErrNotFound (both wrapped), or
	// an I/O error.
	Open(ctx context.Context, key string) (io.ReadCloser, error)
	// Create starts a write session for key. Nothing is visible under key
	// until Writer.Commit succeeds; an existing object stays readable until
	// then and is replaced atomically by the commit. Errors: ErrInvalidKey
	// (wrapped) or an I/O error.
	Create(ctx context.Context, key string) (Writer, error)
	// Stat describes the object published under key. Errors: ErrInvalidKey,
	// ErrNotFound (both wrapped), or an I/O error.
	Stat(ctx context.Context, key string) (Info, error)
}

// Writer is a write session for one object. It is not safe for concurrent
// use. Exactly one of Commit or Abort ends the session; after that Write and
// Commit return ErrClosed (wrapped) and Abort returns nil. A session that is
// never ended (for example because the process died) never makes a partial
// object visible; Local leaves at most a hidden temporary file behind.
type Writer interface {
	io.Writer
	// Commit makes everything written so far visible under the key,
	// atomically replacing any previous object. When several sessions
	// commit to the same key, the last commit wins; a reader never sees a
	// mix. If Commit fails, nothing is published and the session is closed.
	Commit(ctx context.Context) error
	// Abort discards the session; nothing becomes visible under the key.
	Abort(ctx context.Context) error
}

// Info describes a published object.
type Info struct {
	// Key is the object's key.
	Key string
	// Size is the object's size in bytes.
	Size int64
	// ModTime is the time of the commit that published the object.
	ModTime time.Time
}

// tempPrefix starts the base name of every temporary file of a write
// session; keys may not contain a segment with this prefix.
const tempPrefix = ".capstan-tmp-"

// MaxSegmentBytes bounds one segment of a key, so that a write session's
// temporary name beside it still fits a file name (255 bytes).
const MaxSegmentBytes = 200

// ValidateKey reports whether key is a valid object key: a non-empty,
// valid UTF-8, slash-separated relative path whose segments are non-empty and
// not "." or "..", with no NUL byte, no backslash and no segment starting with
// the reserved temporary prefix ".capstan-tmp-" and none longer than
// MaxSegmentBytes. The error wraps
// ErrInvalidKey and names the key.
func ValidateKey(key string) error {
	reason := keyProblem(key)
	if reason == "" {
		return nil
	}
	return fmt.Errorf("%w %q: %s", ErrInvalidKey, key, reason)
}

func keyProblem(key string) string {
	switch {
	case key == "":
		return "empty"
	case !utf8.ValidString(key):
		return "not valid UTF-8"
	case strings.IndexByte(key, 0) >= 0:
		return "contains NUL"
	case strings.IndexByte(key, '\\') >= 0:
		return "contains backslash"
	case strings.HasPrefix(key, "/"):
		return "absolute path"
	}
	for seg := range strings.SplitSeq(key, "/") {
		switch {
		case seg == "":
			return "empty path segment"
		case seg == "." || seg == "..":
			return "dot segment " + seg
		case strings.HasPrefix(seg, tempPrefix):
			return "reserved segment prefix " + tempPrefix
		case len(seg) > MaxSegmentBytes:
			return fmt.Sprintf("path segment longer than %d bytes", MaxSegmentBytes)
		}
	}
	return ""
}
