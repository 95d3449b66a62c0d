package devstack

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// process is one child OS process of the dev stack, with its output in a
// log file of the run folder.
type process struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan error
}

// startProcess starts bin with args and env, logging to <runDir>/<name>.log
// (and to extra, when not nil). The child gets SIGKILL if this process
// dies, so a killed `capstanctl dev` leaves no stray daemons.
func startProcess(name, bin string, args, env []string, runDir string, extra io.Writer) (*process, error) {
	f, err := os.Create(fmt.Sprintf("%s/%s.log", runDir, name))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	var out io.Writer = f
	if extra != nil {
		out = io.MultiWriter(f, extra)
	}
	cmd.Stdout, cmd.Stderr = out, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	p := &process{name: name, cmd: cmd, log: f, done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait(); f.Close() }()
	return p, nil
}

// stop sends SIGTERM and waits up to grace, then SIGKILLs. It returns the
// process's exit error, if any other than the signal.
func (p *process) stop(grace time.Duration) error {
	if p.cmd.ProcessState != nil {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		return exitErr(err)
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within %v; killed", p.name, grace)
	}
}

// wait waits for the process to exit on its own or ctx to end.
func (p *process) wait(ctx context.Context) error {
	select {
	case err := <-p.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func exitErr(err error) error {
	if ee, ok := err.(*exec.ExitError); ok {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			return nil
		}
	}
	return err
}
