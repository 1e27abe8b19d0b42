//! A TPACKET_V2 receive ring on an AF_PACKET socket: the kernel writes each frame, with its
//! receive stamp, into memory shared with us, so taking a frame costs no system call (a
//! `recvmsg` per frame was ~15% of the emulator's CPU at 300 Mbit/s). `poll` on the socket
//! still says when frames wait. V2 rather than V3: V3 hands over whole blocks, so a lone frame
//! would wait for the block's retire timer (>= 1 ms), which becomes emulated delay.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{fence, Ordering};

/// Frames in the ring: 19 ms at 2.6 Gbit/s of full-size frames (the emulator's ceiling),
/// seconds at the rates labs emulate.
const FRAMES: usize = 4096;
/// Ring memory is allocated in blocks of this size (contiguous pages each).
const BLOCK: usize = 1 << 16;

/// One received frame, valid until the closure given to `RxRing::take` returns.
pub struct RxFrame<'a> {
    pub data: &'a [u8],
    /// The kernel's receive stamp (CLOCK_REALTIME, ns).
    pub stamp_ns: u64,
    /// The frame was longer than a ring slot and is cut (`data` is its start).
    pub truncated: bool,
}

pub struct RxRing {
    map: *mut u8,
    len: usize,
    frame_size: usize,
    head: usize,
}

// SAFETY: the mapping is owned by this value and only touched through `&mut self`.
unsafe impl Send for RxRing {}

impl RxRing {
    /// Set up the ring on `fd` (an unbound-ring AF_PACKET socket) for frames up to `max_frame`
    /// bytes (link header included).
    pub fn new(fd: RawFd, max_frame: usize) -> io::Result<RxRing> {
        // Slot: header, sockaddr_ll, alignment padding, then the frame; a power of two so
        // slots tile the blocks.
        let frame_size = (max_frame + libc::TPACKET2_HDRLEN + 2 * libc::TPACKET_ALIGNMENT)
            .next_power_of_two()
            .max(2048);
        let block = BLOCK.max(frame_size);
        let frames = FRAMES.div_ceil(block / frame_size) * (block / frame_size);
        let version = libc::tpacket_versions::TPACKET_V2 as i32;
        setopt(fd, libc::SOL_PACKET, libc::PACKET_VERSION, &version)?;
        let req = libc::tpacket_req {
            tp_block_size: block as u32,
            tp_block_nr: (frames * frame_size / block) as u32,
            tp_frame_size: frame_size as u32,
            tp_frame_nr: frames as u32,
        };
        setopt(fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)?;
        let len = frames * frame_size;
        // SAFETY: maps the ring the kernel just allocated for this socket; checked below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(RxRing {
            map: map.cast(),
            len,
            frame_size,
            head: 0,
        })
    }

    /// Hand the next waiting frame to `f`, then give its slot back to the kernel; `None` when
    /// no frame waits.
    pub fn take<R>(&mut self, f: impl FnOnce(RxFrame<'_>) -> R) -> Option<R> {
        // SAFETY: `head` < number of slots, so the slot lies inside the mapping; slots are
        // 16-byte aligned, as tpacket2_hdr needs.
        let hdr = unsafe { self.map.add(self.head * self.frame_size) }.cast::<libc::tpacket2_hdr>();
        // SAFETY: the kernel writes tp_status concurrently; a volatile read sees its last store.
        let status = unsafe { std::ptr::addr_of!((*hdr).tp_status).read_volatile() };
        if status & libc::TP_STATUS_USER == 0 {
            return None;
        }
        // The frame's bytes were written before the status that published them.
        fence(Ordering::Acquire);
        // SAFETY: the slot is ours until we set TP_STATUS_KERNEL; the kernel keeps mac offset +
        // snaplen inside the slot.
        let r = unsafe {
            let h = &*hdr;
            let start = usize::from(h.tp_mac);
            let snap = (h.tp_snaplen as usize).min(self.frame_size.saturating_sub(start));
            f(RxFrame {
                data: std::slice::from_raw_parts(hdr.cast::<u8>().add(start), snap),
                stamp_ns: u64::from(h.tp_sec) * 1_000_000_000 + u64::from(h.tp_nsec),
                truncated: h.tp_snaplen < h.tp_len,
            })
        };
        // Our reads of the frame happen before the kernel may reuse the slot.
        fence(Ordering::Release);
        // SAFETY: as above; handing the slot back.
        unsafe { std::ptr::addr_of_mut!((*hdr).tp_status).write_volatile(libc::TP_STATUS_KERNEL) };
        self.head = (self.head + 1) % (self.len / self.frame_size);
        Some(r)
    }
}

impl Drop for RxRing {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

/// `setsockopt` of `v` (the option's type) on a socket (here and the lab's other packet sockets).
pub fn setopt<T>(fd: RawFd, level: i32, name: i32, v: &T) -> io::Result<()> {
    // SAFETY: `v` is the option's type for `name` and lives across the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as u32,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Packets a packet socket dropped since the last call (its ring or buffer was full).
pub fn take_drops(fd: RawFd) -> u64 {
    let mut st = libc::tpacket_stats {
        tp_packets: 0,
        tp_drops: 0,
    };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: PACKET_STATISTICS fills a tpacket_stats of `len` bytes (and resets it).
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            (&mut st as *mut libc::tpacket_stats).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        u64::from(st.tp_drops)
    } else {
        0
    }
}
