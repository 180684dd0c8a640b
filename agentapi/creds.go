package agentapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/rlimits"
)

// Callers are identified by SO_PEERCRED, read at accept, never by anything they send: root may do
// anything, another uid sees and acts on its own jobs only.

type credKey struct{}

// WithCaller records the caller's credentials in a request's context, as the server does from its
// connection. Only code in the agent's process can call it (tests of the handler do): a client cannot.
func WithCaller(ctx context.Context, cred *unix.Ucred) context.Context {
	return context.WithValue(ctx, credKey{}, cred)
}

// peerCred reads the connecting process's credentials from a unix socket.
func peerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, errors.New("not a unix socket")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// callerLimits reads the resource limits of the caller's process, the one SO_PEERCRED named at connect.
// By now that PID may name a process that is not wholly the caller's: the caller exec'd a set-uid program,
// which may raise its own limits (sudo does, before it asks for a password), or it exited and the PID went
// to another process. Root applies these limits to the job before it drops its privileges, so they count
// only if the process read is still the caller's uid in every respect (real, effective, saved,
// filesystem) with no capabilities (root aside), checked after the read, and a pidfd taken before it shows
// the process lived throughout: the PID named the same process for both reads.
func callerLimits(c *unix.Ucred) ([]rlimits.Limit, error) {
	fd, err := unix.PidfdOpen(int(c.Pid), 0)
	if err != nil {
		return nil, fmt.Errorf("open a pidfd for the caller's process %d: %w", c.Pid, err)
	}
	defer unix.Close(fd)
	ls, err := rlimits.Of(int(c.Pid))
	if err != nil {
		return nil, err
	}
	status, err := os.ReadFile("/proc/" + strconv.Itoa(int(c.Pid)) + "/status")
	if err != nil {
		return nil, fmt.Errorf("read the caller's process %d: %w", c.Pid, err)
	}
	if err := unix.PidfdSendSignal(fd, 0, nil, 0); err != nil {
		return nil, fmt.Errorf("the caller's process %d is gone: %w", c.Pid, err)
	}
	uids, caps := "", ""
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "Uid:"); ok {
			uids = v
		} else if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps = strings.TrimSpace(v)
		}
	}
	fields := strings.Fields(uids)
	if len(fields) != 4 || caps == "" {
		return nil, fmt.Errorf("process %d: no readable Uid and CapEff lines in its status", c.Pid)
	}
	for _, f := range fields {
		if f != strconv.FormatUint(uint64(c.Uid), 10) {
			return nil, fmt.Errorf("process %d is no longer wholly of uid %d (uids %s): its limits are not the caller's", c.Pid, c.Uid, strings.Join(fields, " "))
		}
	}
	// A program with file capabilities (cap_sys_resource) raises its limits under the caller's uid.
	if c.Uid != 0 && strings.Trim(caps, "0") != "" {
		return nil, fmt.Errorf("process %d of uid %d holds capabilities %s: its limits are not the caller's", c.Pid, c.Uid, caps)
	}
	return ls, nil
}

// callerUmask reads the umask of the caller's process (the Umask line of its status), nil if it cannot be
// read or the process is no longer the caller's: gone (a pidfd taken before the read shows it lived
// throughout), or its PID went to a process of another real uid. A umask grants nothing, so a set-uid
// program the caller exec'd may give its own: the job gets no more than its user could set.
func callerUmask(c *unix.Ucred) *uint32 {
	fd, err := unix.PidfdOpen(int(c.Pid), 0)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	status, err := os.ReadFile("/proc/" + strconv.Itoa(int(c.Pid)) + "/status")
	if err != nil || unix.PidfdSendSignal(fd, 0, nil, 0) != nil {
		return nil
	}
	var umask *uint32
	uidOK := false
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "Umask:"); ok {
			if m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil && m <= 0o777 {
				u := uint32(m)
				umask = &u
			}
		} else if v, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(v)
			uidOK = len(f) > 0 && f[0] == strconv.FormatUint(uint64(c.Uid), 10)
		}
	}
	if !uidOK {
		return nil
	}
	return umask
}

func callerOf(r *http.Request) *unix.Ucred {
	c, _ := r.Context().Value(credKey{}).(*unix.Ucred)
	return c
}

func requireCred(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r) == nil {
			writeError(w, http.StatusForbidden, errors.New("caller credentials unavailable"))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// credListener reads each connection's SO_PEERCRED at accept and caps the connections of non-root uids.
// A connection over the cap is refused on a goroutine of its own, so that one user's flood never blocks the
// accept loop for another.
type credListener struct {
	net.Listener
	lim      Limits
	log      *slog.Logger
	refusing chan struct{} // a slot per connection being refused
	mu       sync.Mutex
	byUID    map[uint32]int
	total    int
	refused  int       // since the last warning
	warned   time.Time // of the last warning
}

// maxRefusing bounds the connections being answered with a refusal at once; beyond, they are just closed.
const maxRefusing = 32

func newCredListener(ln net.Listener, lim Limits, log *slog.Logger) *credListener {
	return &credListener{Listener: ln, lim: lim, log: log, byUID: map[uint32]int{}, refusing: make(chan struct{}, maxRefusing)}
}

// credConn is an accepted connection with its caller's credentials (nil if unreadable).
type credConn struct {
	net.Conn
	cred    *unix.Ucred
	release func()
	once    sync.Once
}

func (c *credConn) Close() error {
	c.once.Do(c.release)
	return c.Conn.Close()
}

func (l *credListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cred, err := peerCred(c)
		if err != nil {
			// Served, and refused per request by requireCred: the client learns why.
			l.log.Warn("local API: caller credentials unavailable", "err", err)
			return &credConn{Conn: c, release: func() {}}, nil
		}
		if err := l.acquire(cred.Uid); err != nil {
			select {
			case l.refusing <- struct{}{}:
				go func() {
					defer func() { <-l.refusing }()
					refuse(c, err)
				}()
			default:
				c.Close()
			}
			continue
		}
		return &credConn{Conn: c, cred: cred, release: func() { l.release(cred.Uid) }}, nil
	}
}

// acquire counts a connection of uid, or says why it is over the limits.
func (l *credListener) acquire(uid uint32) error {
	if uid == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var err error
	switch {
	case l.byUID[uid] >= l.lim.connsPerUID:
		err = fmt.Errorf("uid %d already has %d connections to the agent, its limit: close some", uid, l.byUID[uid])
	case l.total >= l.lim.conns:
		err = fmt.Errorf("the agent already serves %d connections of users, its limit: retry later", l.total)
	default:
		l.byUID[uid]++
		l.total++
		return nil
	}
	// A flood of refusals must not flood the log too.
	if l.refused++; time.Since(l.warned) >= 10*time.Second {
		l.log.Warn("local API: connections refused", "count", l.refused, "last_uid", uid, "err", err)
		l.refused, l.warned = 0, time.Now()
	}
	return err
}

func (l *credListener) release(uid uint32) {
	if uid == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byUID[uid]--; l.byUID[uid] <= 0 {
		delete(l.byUID, uid)
	}
	l.total--
}

// refuse answers a connection that is over the limits with a 503 and closes it. The request is read
// first (briefly, and only its head): an HTTP client that gets an answer before it has sent its request
// reports a broken pipe instead of the reason.
func refuse(c net.Conn, why error) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := http.ReadRequest(bufio.NewReader(io.LimitReader(c, 16<<10))); err != nil {
		return
	}
	body, _ := json.Marshal(apiError{Error: why.Error()})
	fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}
