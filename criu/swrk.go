package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// swrk is one `criu swrk` this package started itself, speaking CRIU's RPC as go-criu does
// (doSwrkWithResp). go-criu keeps its process to itself: a dump whose context ended could only return and
// leave CRIU running, which then went on dumping (and freezing) a job its caller had thawed, into a
// directory its caller had removed.
type swrk struct {
	cmd *exec.Cmd
	sk  *os.File
}

// errOpFailed is CRIU's answer that a request failed: CRIU then undid what it did (its network lock too).
var errOpFailed = errors.New("operation failed")

// swrkFD is the socket's descriptor number in CRIU (exec.Cmd.ExtraFiles start at 3).
const swrkFD = 3

// startSwrk starts `binary swrk` from the calling thread (CRIU works in the thread's network namespace), in
// a process group of its own, so that kill reaches the helpers it forks too. withCaller also has the kernel
// kill CRIU when the thread that started it ends (PR_SET_PDEATHSIG): only for a caller locked to its thread
// until CRIU is reaped (runtime.LockOSThread), whose own death must end CRIU.
func startSwrk(binary string, withCaller bool) (*swrk, error) {
	fds, err := unix.Socketpair(unix.AF_LOCAL, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("criu swrk socket: %w", err)
	}
	cln, srv := os.NewFile(uintptr(fds[0]), "criu-xprt-cln"), os.NewFile(uintptr(fds[1]), "criu-xprt-srv")
	defer srv.Close()
	cmd := exec.Command(binary, "swrk", fmt.Sprint(swrkFD)) // #nosec G204: the configured CRIU
	cmd.ExtraFiles = []*os.File{srv}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if withCaller {
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	if err := cmd.Start(); err != nil {
		cln.Close()
		return nil, fmt.Errorf("start criu swrk: %w", err)
	}
	return &swrk{cmd: cmd, sk: cln}, nil
}

// call sends one request of type typ and answers CRIU's notifications with nfy (nil: none) until CRIU's
// reply.
func (s *swrk) call(typ rpc.CriuReqType, opts *rpc.CriuOpts, nfy gocriu.Notify) error {
	if nfy != nil {
		opts.NotifyScripts = proto.Bool(true)
	}
	req := &rpc.CriuReq{Type: &typ, Opts: opts}
	buf := make([]byte, 2*4096)
	for {
		b, err := proto.Marshal(req)
		if err != nil {
			return err
		}
		if _, err := s.sk.Write(b); err != nil {
			return err
		}
		n, err := s.sk.Read(buf)
		if err != nil {
			return err
		}
		resp := &rpc.CriuResp{}
		if err := proto.Unmarshal(buf[:n], resp); err != nil {
			return err
		}
		if !resp.GetSuccess() {
			return fmt.Errorf("%w (msg:%s err:%d)", errOpFailed, resp.GetCrErrmsg(), resp.GetCrErrno())
		}
		rt := resp.GetType()
		if rt != rpc.CriuReqType_NOTIFY {
			if rt != typ {
				return errors.New("unexpected CRIU RPC response")
			}
			return nil
		}
		if nfy == nil {
			return errors.New("unexpected notify")
		}
		if err := notify(nfy, resp.GetNotify()); err != nil {
			return err
		}
		req = &rpc.CriuReq{Type: &rt, NotifySuccess: proto.Bool(true)}
	}
}

// version asks CRIU for its version (a VERSION request).
func (s *swrk) version() (*rpc.CriuVersion, error) {
	typ := rpc.CriuReqType_VERSION
	b, err := proto.Marshal(&rpc.CriuReq{Type: &typ})
	if err != nil {
		return nil, err
	}
	if _, err := s.sk.Write(b); err != nil {
		return nil, err
	}
	buf := make([]byte, 2*4096)
	n, err := s.sk.Read(buf)
	if err != nil {
		return nil, err
	}
	resp := &rpc.CriuResp{}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		return nil, err
	}
	if !resp.GetSuccess() {
		return nil, fmt.Errorf("%w (msg:%s err:%d)", errOpFailed, resp.GetCrErrmsg(), resp.GetCrErrno())
	}
	if resp.GetType() != typ || resp.GetVersion() == nil {
		return nil, errors.New("unexpected CRIU RPC response")
	}
	return resp.GetVersion(), nil
}

// notify hands one of CRIU's notifications to nfy, as go-criu does.
func notify(nfy gocriu.Notify, n *rpc.CriuNotify) error {
	switch n.GetScript() {
	case "pre-dump":
		return nfy.PreDump()
	case "post-dump":
		return nfy.PostDump()
	case "pre-restore":
		return nfy.PreRestore()
	case "post-restore":
		return nfy.PostRestore(n.GetPid())
	case "network-lock":
		return nfy.NetworkLock()
	case "network-unlock":
		return nfy.NetworkUnlock()
	case "setup-namespaces":
		return nfy.SetupNamespaces(n.GetPid())
	case "post-setup-namespaces":
		return nfy.PostSetupNamespaces()
	case "post-resume":
		return nfy.PostResume()
	}
	return nil
}

// kill ends CRIU and whatever it forked (its process group) at once.
func (s *swrk) kill() {
	unix.Kill(-s.cmd.Process.Pid, unix.SIGKILL)
}

// wait closes the socket and reaps CRIU.
func (s *swrk) wait() error {
	s.sk.Close()
	if err := s.cmd.Wait(); err != nil {
		return fmt.Errorf("criu swrk failed: %w", err)
	}
	return nil
}

// do runs call, a request on s, until it returns or ctx ends: then CRIU is killed, and do returns ctx's
// error only once CRIU is gone (reaped), so that the caller may thaw the job (a dump), or kill what CRIU
// restored so far (a restore), and remove the images directory without a CRIU still at work on them.
func (s *swrk) do(ctx context.Context, call func() error) error {
	done := make(chan error, 1)
	go func() { done <- call() }()
	select {
	case err := <-done:
		return errors.Join(err, s.wait())
	case <-ctx.Done():
		s.kill()
		<-done // CRIU's end of the socket is closed with it: the call returns
		s.wait()
		return fmt.Errorf("criu killed: %w", context.Cause(ctx))
	}
}
