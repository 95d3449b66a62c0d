package objectstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newLocal(t *testing.T) (*Local, string) {
	t.Helper()
	dir := t.TempDir()
	l, err := NewLocal(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l, dir
}

func read(t *testing.T, s Store, key string) string {
	t.Helper()
	r, err := s.Open(context.Background(), key)
	if err != nil {
		t.Fatalf("open %q: %v", key, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// entries lists every file under dir, relative and slash-separated.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestCommitMakesVisible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	const key = "exec/42/out.csv"

	if _, err := l.Stat(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("stat before create: %v, want ErrNotFound", err)
	}
	w, err := l.Create(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(w, "a,b\n1,2\n"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Open(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("open before commit: %v, want ErrNotFound", err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := read(t, l, key); got != "a,b\n1,2\n" {
		t.Fatalf("content %q", got)
	}
	info, err := l.Stat(ctx, key)
	if err != nil || info.Size != 8 || info.Key != key {
		t.Fatalf("stat = %+v, %v", info, err)
	}
	if got := entries(t, dir); len(got) != 1 || got[0] != key {
		t.Fatalf("files %v, want only %s", got, key)
	}
	// Session is closed after commit.
	if _, err := w.Write([]byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("write after commit: %v", err)
	}
	if err := w.Commit(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("second commit: %v", err)
	}
	if err := w.Abort(ctx); err != nil {
		t.Fatalf("abort after commit: %v", err)
	}
	if got := read(t, l, key); got != "a,b\n1,2\n" {
		t.Fatalf("abort after commit changed content: %q", got)
	}
}

func TestCommitReplacesExisting(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, _ := newLocal(t)
	for _, content := range []string{"first", "second"} {
		w, err := l.Create(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.WriteString(w, content)
		if content == "second" {
			if got := read(t, l, "k"); got != "first" {
				t.Fatalf("old object not readable during session: %q", got)
			}
		}
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := read(t, l, "k"); got != "second" {
		t.Fatalf("got %q", got)
	}
}

func TestAbortLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	w, err := l.Create(ctx, "a/b.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(w, "{}\n")
	if err := w.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Stat(ctx, "a/b.jsonl"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("stat after abort: %v", err)
	}
	if got := entries(t, dir); len(got) != 0 {
		t.Fatalf("files left after abort: %v", got)
	}
	if err := w.Commit(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("commit after abort: %v", err)
	}
	if err := w.Abort(ctx); err != nil {
		t.Fatalf("second abort: %v", err)
	}
}

// TestCrashWithoutCommit simulates process death: the session is dropped
// without Commit or Abort and the store is reopened.
func TestCrashWithoutCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	l, err := NewLocal(dir)
	if err != nil {
		t.Fatal(err)
	}
	w, err := l.Create(ctx, "out.csv")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(w, "partial")
	lw := w.(*localWriter)
	_ = lw.f.Close() // the process dies: the fd goes away, nothing else happens
	_ = l.Close()

	l2, err := NewLocal(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if _, err := l2.Open(ctx, "out.csv"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("open after crash: %v, want ErrNotFound", err)
	}
	for _, f := range entries(t, dir) {
		if !strings.HasPrefix(filepath.Base(f), tempPrefix) {
			t.Fatalf("visible file after crash: %s", f)
		}
	}
}

func TestCommitCanceledContext(t *testing.T) {
	t.Parallel()
	l, dir := newLocal(t)
	w, err := l.Create(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Commit(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("commit: %v", err)
	}
	if got := entries(t, dir); len(got) != 0 {
		t.Fatalf("files left: %v", got)
	}
}

func TestConcurrentWritersLastCommitWins(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	const (
		writers = 8
		chunks  = 64
		key     = "shared/out.bin"
	)
	chunk := func(i int) []byte { return bytes.Repeat([]byte{byte('A' + i)}, 4096) }

	// All sessions write fully before anyone commits, then commit in a
	// known order: the last commit wins.
	ws := make([]Writer, writers)
	var wg sync.WaitGroup
	for i := range writers {
		w, err := l.Create(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		ws[i] = w
		wg.Go(func() {
			for range chunks {
				if _, err := w.Write(chunk(i)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	for i, w := range ws {
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := read(t, l, key); got != strings.Repeat(string(chunk(i)), chunks) {
			t.Fatalf("after commit %d: content is not writer %d's", i, i)
		}
	}

	// Racing commits and readers: every read sees exactly one writer's
	// complete content, never a mix or a prefix.
	stop := make(chan struct{})
	var readers sync.WaitGroup
	for range 4 {
		readers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := l.Open(ctx, key)
				if err != nil {
					t.Error(err)
					return
				}
				b, err := io.ReadAll(r)
				_ = r.Close()
				if err != nil {
					t.Error(err)
					return
				}
				if len(b) != 4096*chunks || !bytes.Equal(b, bytes.Repeat(b[:1], len(b))) {
					t.Errorf("mixed or partial content: len %d", len(b))
					return
				}
			}
		})
	}
	for i := range writers {
		wg.Go(func() {
			w, err := l.Create(ctx, key)
			if err != nil {
				t.Error(err)
				return
			}
			for range chunks {
				_, _ = w.Write(chunk(i))
			}
			if err := w.Commit(ctx); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	close(stop)
	readers.Wait()
	if got := entries(t, dir); len(got) != 1 {
		t.Fatalf("files %v, want only %s", got, key)
	}
}

var invalidKeys = []struct{ name, key string }{
	{"empty", ""},
	{"absolute", "/etc/passwd"},
	{"dotdot", "../x"},
	{"inner dotdot", "a/../../x"},
	{"trailing dotdot", "a/.."},
	{"dot", "./a"},
	{"only dot", "."},
	{"empty segment", "a//b"},
	{"trailing slash", "a/"},
	{"nul", "a\x00b"},
	{"backslash", `a\..\b`},
	{"invalid utf8", "a\xffb"},
	{"temp prefix", "a/.capstan-tmp-x"},
}

func TestInvalidKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	for _, tc := range invalidKeys {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := ValidateKey(tc.key)
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("ValidateKey(%q) = %v, want ErrInvalidKey", tc.key, err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q", tc.key)) {
				t.Fatalf("error %q does not name the key", err)
			}
			if _, err := l.Open(ctx, tc.key); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Open: %v", err)
			}
			if _, err := l.Stat(ctx, tc.key); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Stat: %v", err)
			}
			if _, err := l.Create(ctx, tc.key); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Create: %v", err)
			}
		})
	}
	t.Cleanup(func() {
		if got := entries(t, dir); len(got) != 0 {
			t.Errorf("files created for invalid keys: %v", got)
		}
	})
}

func TestValidKeys(t *testing.T) {
	t.Parallel()
	for _, key := range []string{"a", "a/b/c.csv", "..a", "a..", ".hidden/x", "exec-1/ünïcode.jsonl"} {
		if err := ValidateKey(key); err != nil {
			t.Errorf("ValidateKey(%q) = %v", key, err)
		}
	}
}

func TestDirectoryIsNotAnObject(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, _ := newLocal(t)
	w, err := l.Create(ctx, "d/f")
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Stat(ctx, "d"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Stat dir: %v", err)
	}
	if _, err := l.Open(ctx, "d"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Open dir: %v", err)
	}
	if _, err := l.Open(ctx, "d/f/g"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Open below file: %v", err)
	}
}

func TestSymlinkEscapeRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "link")); err != nil {
		t.Skip("symlinks unsupported:", err)
	}
	if _, err := l.Open(ctx, "link/secret"); err == nil {
		t.Fatal("open through symlink escaping the root succeeded")
	}
	if _, err := l.Create(ctx, "link/new"); err == nil {
		t.Fatal("create through symlink escaping the root succeeded")
	}
}

func FuzzValidateKey(f *testing.F) {
	for _, tc := range invalidKeys {
		f.Add(tc.key)
	}
	f.Add("a/b/c.csv")
	f.Add("..a/b..")
	f.Fuzz(func(t *testing.T, key string) {
		err := ValidateKey(key)
		if err != nil {
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("error does not wrap ErrInvalidKey: %v", err)
			}
			return
		}
		// A valid key is a clean, relative, local path that stays inside
		// the root and is not a temporary name.
		if !filepath.IsLocal(key) || filepath.Clean(key) != filepath.FromSlash(key) {
			t.Fatalf("accepted unsafe key %q", key)
		}
		if strings.ContainsRune(key, 0) || strings.HasPrefix(key, "/") {
			t.Fatalf("accepted key %q", key)
		}
		for seg := range strings.SplitSeq(key, "/") {
			if seg == "" || seg == "." || seg == ".." || strings.HasPrefix(seg, tempPrefix) {
				t.Fatalf("accepted key %q with segment %q", key, seg)
			}
		}
	})
}

// TestFIFOIsNotAnObject: a named pipe under a key is not an object, and
// Open returns at once instead of blocking on it.
func TestFIFOIsNotAnObject(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, dir := newLocal(t)
	if err := syscall.Mkfifo(filepath.Join(dir, "pipe.csv"), 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	if _, err := l.Open(ctx, "pipe.csv"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Open fifo: %v", err)
	}
}
