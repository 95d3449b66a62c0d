package objectstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sync"
	"syscall"
)

// Local is a Store on a root directory of the local file system. A key maps
// to the file at root/key; parent directories are created on demand (mode
// 0o755) and objects are written with mode 0o644. All access goes through
// an os.Root, so symbolic links cannot lead outside the root.
//
// Commit writes to a temporary file in the key's directory, fsyncs it,
// renames it over the key and fsyncs the directory. Temporary files of
// sessions that were never ended (process death) carry the prefix
// ".capstan-tmp-" and are never visible as objects.
type Local struct {
	root *os.Root
}

var _ Store = (*Local)(nil)

// NewLocal opens a Local store on the existing directory dir. The caller must
// Close it.
func NewLocal(dir string) (*Local, error) {
	r, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("objectstore: open root %q: %w", dir, err)
	}
	return &Local{root: r}, nil
}

// Close releases the root directory. Sessions still open fail afterwards.
func (l *Local) Close() error {
	if err := l.root.Close(); err != nil {
		return fmt.Errorf("objectstore: close root: %w", err)
	}
	return nil
}

// Open implements Store. Anything but a regular file under key (a
// directory, a FIFO, a device) is reported as ErrNotFound, checked before
// opening: opening a FIFO would block.
func (l *Local) Open(ctx context.Context, key string) (io.ReadCloser, error) {
	if err := check(ctx, key); err != nil {
		return nil, err
	}
	if st, err := l.root.Stat(key); err != nil {
		return nil, mapErr("open", key, err)
	} else if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("objectstore: open %q: not a regular file: %w", key, ErrNotFound)
	}
	f, err := l.root.Open(key)
	if err != nil {
		return nil, mapErr("open", key, err)
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("objectstore: open %q: %w", key, err)
	}
	if !st.Mode().IsRegular() {
		_ = f.Close()
		return nil, fmt.Errorf("objectstore: open %q: %w", key, ErrNotFound)
	}
	return f, nil
}

// Stat implements Store. A directory under key is reported as ErrNotFound.
func (l *Local) Stat(ctx context.Context, key string) (Info, error) {
	if err := check(ctx, key); err != nil {
		return Info{}, err
	}
	st, err := l.root.Stat(key)
	if err != nil {
		return Info{}, mapErr("stat", key, err)
	}
	if !st.Mode().IsRegular() {
		return Info{}, fmt.Errorf("objectstore: stat %q: %w", key, ErrNotFound)
	}
	return Info{Key: key, Size: st.Size(), ModTime: st.ModTime()}, nil
}

// Create implements Store.
func (l *Local) Create(ctx context.Context, key string) (Writer, error) {
	if err := check(ctx, key); err != nil {
		return nil, err
	}
	dir := path.Dir(key)
	if dir != "." {
		if err := l.root.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("objectstore: create %q: %w", key, err)
		}
	}
	var rnd [12]byte
	_, _ = rand.Read(rnd[:]) // crypto/rand.Read never fails
	tmp := path.Join(dir, tempPrefix+path.Base(key)+"-"+hex.EncodeToString(rnd[:]))
	f, err := l.root.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, fmt.Errorf("objectstore: create %q: %w", key, err)
	}
	return &localWriter{l: l, key: key, dir: dir, tmp: tmp, f: f}, nil
}

type localWriter struct {
	l             *Local
	key, dir, tmp string

	mu     sync.Mutex
	f      *os.File
	closed bool
}

func (w *localWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return 0, fmt.Errorf("objectstore: write %q: %w", w.key, ErrClosed)
	}
	n, err := w.f.Write(p)
	if err != nil {
		return n, fmt.Errorf("objectstore: write %q: %w", w.key, err)
	}
	return n, nil
}

func (w *localWriter) Commit(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return fmt.Errorf("objectstore: commit %q: %w", w.key, ErrClosed)
	}
	w.closed = true
	if err := ctx.Err(); err != nil {
		return errors.Join(fmt.Errorf("objectstore: commit %q: %w", w.key, err), w.discard())
	}
	if err := w.f.Sync(); err != nil {
		return errors.Join(fmt.Errorf("objectstore: commit %q: sync: %w", w.key, err), w.discard())
	}
	if err := w.f.Close(); err != nil {
		return errors.Join(fmt.Errorf("objectstore: commit %q: close: %w", w.key, err), w.remove())
	}
	if err := w.l.root.Rename(w.tmp, w.key); err != nil {
		return errors.Join(fmt.Errorf("objectstore: commit %q: rename: %w", w.key, err), w.remove())
	}
	// Make the rename durable. The object is already visible, so a failure
	// here is reported but does not undo the publish.
	d, err := w.l.root.Open(w.dir)
	if err != nil {
		return fmt.Errorf("objectstore: commit %q: open dir: %w", w.key, err)
	}
	serr := d.Sync()
	cerr := d.Close()
	if err := errors.Join(serr, cerr); err != nil {
		return fmt.Errorf("objectstore: commit %q: sync dir: %w", w.key, err)
	}
	return nil
}

func (w *localWriter) Abort(context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	w.closed = true
	if err := w.discard(); err != nil {
		return fmt.Errorf("objectstore: abort %q: %w", w.key, err)
	}
	return nil
}

// discard closes and removes the temporary file.
func (w *localWriter) discard() error {
	_ = w.f.Close()
	return w.remove()
}

func (w *localWriter) remove() error {
	if err := w.l.root.Remove(w.tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove temp: %w", err)
	}
	return nil
}

func check(ctx context.Context, key string) error {
	if err := ValidateKey(key); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("objectstore: %q: %w", key, err)
	}
	return nil
}

func mapErr(op, key string, err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return fmt.Errorf("objectstore: %s %q: %w: %w", op, key, ErrNotFound, err)
	}
	return fmt.Errorf("objectstore: %s %q: %w", op, key, err)
}
